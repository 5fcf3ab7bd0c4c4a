"""The Markdown table of a bench summary and the notes under it: sweeps, predicted against
measured, where the predicted step goes, failures."""

from __future__ import annotations

from typing import Any

from autooffload.bench.frontier import is_planned
from autooffload.bench.report import (
    PREDICTED_TERMS,
    GiB,
    config_of,
    is_sweep_configuration,
    several_seqs,
    sweep_key,
    where,
    workload_label,
)

# The planner's targets for the planned runs: |peak error| and |step-time error| at most these.
PEAK_ERR_TARGET_PCT, STEP_ERR_TARGET_PCT = 5.0, 15.0


def fmt(value: Any, spec: str = ".2f", scale: float = 1.0) -> str:
    """``value * scale`` formatted by ``spec``; ``-`` for None."""
    if value is None:
        return "-"
    return format(value * scale, spec)


TABLE_HEADER = (
    "| workload | cap | peer | status | tok/s | x vanilla | step ms | pred step ms | step err %"
    " | peak alloc GiB | reserved GiB | x vanilla mem | pred / meas alloc GiB | alloc err %"
    " | pred peak / meas need GiB | peak err % | host RSS GiB | loss | loss vs vanilla"
    " | H2D/D2H/CPU-opt/stall ms |"
)
# Shown only where they say something: the sequence length in a --seq sweep, after the
# workload; MFU when some row has one (a GPU of known peak), after x vanilla.
SEQ_COLUMN, MFU_COLUMN = " seq |", " MFU % |"


def _header(with_seq: bool, with_mfu: bool) -> str:
    header = TABLE_HEADER
    if with_seq:
        header = header.replace(" workload |", " workload |" + SEQ_COLUMN, 1)
    if with_mfu:
        header = header.replace(" x vanilla |", " x vanilla |" + MFU_COLUMN, 1)
    return header


def _pair(predicted: float | None, measured: float | None) -> str:
    return "-" if predicted is None else f"{predicted:.2f} / {fmt(measured)}"


def _host_rss(row: dict[str, Any]) -> str:
    """The host's peak RSS (every rank's summed), and the estimate made before the run."""
    measured = row.get("host_rss_total_gib") or row.get("host_rss_peak_gib")
    estimate = row.get("host_need_gib")
    return fmt(measured, ".1f") + (f" (est {estimate:.1f})" if estimate is not None else "")


def format_table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table (pastes into BENCHMARKS.md) plus notes with the reason of each failure."""
    with_seq = several_seqs(rows)
    with_mfu = any(row.get("mfu") is not None for row in rows)
    header = _header(with_seq, with_mfu)
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    notes = []
    for row in rows:
        if is_sweep_configuration(row):  # listed under the table, the sweep's best row in it
            continue
        status = row["status"]
        if row["message"] and status != "ok":
            first = row["message"]
            notes.append(
                f"- {where(row, with_seq)} / {row['cap']} / {row['peer_label']}: {status}: {first}"
            )
            if status == "skipped":
                status = f"skipped: {first[:80]}"
        bd = row["breakdown"]
        breakdown = (
            "/".join(fmt(bd[k], ".0f", 1e3) for k in ("h2d_s", "d2h_s", "cpu_optim_s", "stall_s"))
            if any(v is not None for v in bd.values())
            else "-"
        )
        check = row["loss_check"]
        loss_vs = fmt(row["loss_vs_vanilla"], "+.4f")
        if check not in ("ok", "n/a", ""):
            loss_vs += f" **{check}**"
        cells = [
            workload_label(row),
            row["cap"],
            row["peer_label"] + (f" [{row['config']}]" if row.get("config") else ""),
            status,
            fmt(row["tokens_per_s"], ".0f"),
            fmt(row["tput_ratio"], ".2f"),
            fmt(row["step_s_median"], ".0f", 1e3),
            fmt(row["predicted_step_s"], ".0f", 1e3),
            fmt(row["step_err_pct"], "+.1f"),
            fmt(row["peak_allocated_gib"]),
            fmt(row["peak_reserved_gib"]),
            fmt(row["mem_ratio"], ".2f"),
            _pair(row["predicted_allocated_gib"], row["measured_allocated_gib"]),
            fmt(row["alloc_err_pct"], "+.1f"),
            _pair(row["predicted_peak_gib"], row["measured_peak_gib"]),
            fmt(row["peak_err_pct"], "+.1f"),
            _host_rss(row),
            fmt(row["loss_final"], ".4f"),
            loss_vs,
            breakdown,
        ]
        if with_mfu:
            cells.insert(6, fmt(row.get("mfu"), ".1f", 100.0))
        if with_seq:
            cells.insert(1, fmt(row.get("seq"), ".0f"))
        lines.append("| " + " | ".join(cells) + " |")
    scaled = [r for r in rows if r.get("scaling") is not None]
    if scaled:
        lines += ["", "Scaling efficiency (tok/s on N GPUs / (N x tok/s on one)):"]
        lines += [
            f"- {where(r, with_seq)} / {r['cap']} / {r['peer_label']}: {r['scaling']:.2f}"
            for r in scaled
        ]
    lines += _sweep_lines(rows, with_seq)
    lines += _prediction_notes(rows, with_seq)
    lines += _predicted_step_lines(rows, with_seq)
    lines += _smallest_cap_lines(rows, with_seq)
    if notes:
        lines += ["", "Notes:", *notes]
    return "\n".join(lines)


def _sweep_lines(rows: list[dict[str, Any]], with_seq: bool = False) -> list[str]:
    """Under the table: each sweep's configurations as run (fastest first), and autooffload's
    throughput over the sweep's best at the same cap."""
    lines: list[str] = []
    for best in (r for r in rows if r.get("sweep_best")):
        key = sweep_key(best)
        configs = [r for r in rows if is_sweep_configuration(r) and sweep_key(r) == key]
        lines += [
            "",
            f"{best['peer_label']} configurations, {where(best, with_seq)} / {best['cap']}:",
        ]
        for row in configs:
            if row["status"] == "ok":
                outcome = (
                    f"{row['tokens_per_s']:.0f} tok/s, peak alloc {fmt(row['peak_allocated_gib'])}"
                    f" / reserved {fmt(row['peak_reserved_gib'])} GiB"
                )
            else:
                outcome = f"{row['status']}: {row['message'] or row['reason'] or ''}"
            mark = " (best)" if row["peer_label"].endswith(f"[{best.get('config')}]") else ""
            lines.append(f"- [{config_of(row)}]{mark}: {outcome}")
        autooffload = [
            r
            for r in rows
            if r["peer_label"].split(" x")[0] == "autooffload"
            and (r["workload"], r["cap"], r.get("nproc") or 1, r.get("seq"))
            == (*key[:3], best.get("seq"))
            and r.get("tokens_per_s")
        ]
        for auto in autooffload:
            if best.get("tokens_per_s"):
                ratio = auto["tokens_per_s"] / best["tokens_per_s"]
                lines.append(f"- {auto['peer_label']}: {ratio:.2f}x the best {best['peer_label']}")
            else:
                lines.append(f"- {auto['peer_label']}: runs; {best['message']}")
    return lines


def _prediction_notes(rows: list[dict[str, Any]], with_seq: bool = False) -> list[str]:
    """Lines on the planned autooffload runs: worst peak / step errors vs the targets, failures."""
    planned = [r for r in rows if is_planned(r["peer_label"])]
    if not planned:
        return []
    lines = ["", "Predicted vs measured (autooffload, (pred - meas) / meas):"]
    for key, target, what in (
        ("peak_err_pct", PEAK_ERR_TARGET_PCT, "peak vs need"),
        ("alloc_err_pct", None, "allocated vs max allocated"),
        ("step_err_pct", STEP_ERR_TARGET_PCT, "step time vs median step"),
    ):
        known = [r for r in planned if r.get(key) is not None]
        if not known:
            continue
        worst = max(known, key=lambda r: abs(r[key]))
        low, high = min(r[key] for r in known), max(r[key] for r in known)
        line = f"- {what}: {low:+.1f}% .. {high:+.1f}%, worst {worst[key]:+.1f}%"
        line += f" ({where(worst, with_seq)} / {worst['cap']})"
        if target is not None:
            inside = sum(abs(r[key]) <= target for r in known)
            line += f"; within +-{target:g}%: {inside} of {len(known)}"
        lines.append(line)
    retried = [r for r in rows if r.get("timed_alloc_retries") and not r.get("sweep_best")]
    if retried:
        lines.append(
            "- allocator retries in the timed steps (each empties the cache and synchronises): "
            + "; ".join(
                f"{where(r, with_seq)} / {r['cap']} / {r['peer_label']}:"
                f" {r['timed_alloc_retries']:g}"
                for r in retried
            )
        )
    failed = [r for r in planned if r["status"] not in ("ok", "skipped")]
    lines.append(
        f"- failed runs (OOM, nothing fits, errors): {len(failed)} of {len(planned)}"
        + "".join(f"; {where(r, with_seq)} / {r['cap']}: {r['status']}" for r in failed)
    )
    return lines


def _predicted_step_lines(rows: list[dict[str, Any]], with_seq: bool = False) -> list[str]:
    """Where each planned run's predicted step goes, next to its measured step."""
    lines = []
    for row in rows:
        terms = row.get("predicted_terms") or {}
        if row.get("predicted_step_s") is None or not any(v is not None for v in terms.values()):
            continue
        parts = [f"{label} {terms[key] * 1e3:.0f}" for key, label in PREDICTED_TERMS if terms[key]]
        measured = fmt(row.get("step_s_median"), ".0f", 1e3)
        lines.append(
            f"- {where(row, with_seq)} / {row['cap']} / {row['peer_label']}: predicted"
            f" {row['predicted_step_s'] * 1e3:.0f} ms ({', '.join(parts)}); measured {measured} ms"
        )
    if not lines:
        return []
    return ["", "Where the predicted step goes (ms; stalls are time beyond compute):", *lines]


def _smallest_cap_lines(rows: list[dict[str, Any]], with_seq: bool = False) -> list[str]:
    """Per planned run, the smallest predicted peak of its search and the cap that leaves the
    planner that much (``planning.cap_for_peak``), beside the profiling steps' own reserved
    peak under this run's cap: the lowest cap this batch is predicted to train under is about
    the larger of the two (under a lower cap the profiling steps stream through fewer buffers)."""
    from autooffload.runtime.control.planning import cap_for_peak

    lines = []
    for row in rows:
        smallest = row.get("smallest_peak_gib")
        if not smallest:
            continue
        cap = cap_for_peak(int(smallest * GiB)) / GiB
        profiling = row.get("profiling_peak_gib")
        beside = f"; its profiling steps {profiling:.2f} GiB reserved" if profiling else ""
        lines.append(
            f"- {where(row, with_seq)} / {row['cap']} / {row['peer_label']}: {smallest:.2f} GiB,"
            f" a cap of {cap:.2f} GiB{beside}"
        )
    if not lines:
        return []
    title = "Smallest predicted peak of the planner's search (the lowest CUDA cap it fits):"
    return ["", title, *lines]
