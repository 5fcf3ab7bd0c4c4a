"""Turn run results into ratios vs vanilla (at the same GPU count and sequence length), a loss
sanity check, scaling efficiency, summary rows and a JSON file."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from autooffload.atomic import write_text_atomic
from autooffload.bench.runner import HOST_MEMORY_PREFIX, failure_message
from autooffload.plan.profile_types import need_from_peaks

GiB = 1 << 30
SCHEMA = "autooffload.bench/1"

# Loss sanity check (same seed, same init, same batch for every peer), step by step:
# - the first step's loss (before any update) must agree with vanilla's within
#   FIRST_TOL_ABS + FIRST_TOL_REL x |loss| (only kernel / dtype differences separate peers there);
# - each later step of the check window within max(FINAL_TOL_ABS, FINAL_TOL_DROP x the largest
#   drop of vanilla's loss so far): a peer that drops or mangles updates misses by a large part
#   of the drop. Pure-bf16 vanilla against an fp32-master peer may legitimately differ by a few
#   percent of it.
# The window ends with the step at which vanilla's loss first rises by more than FINAL_TOL_ABS
# over its previous step (at least CHECK_MIN_STEPS steps: the first update is always compared):
# training on one repeated batch at lr 1e-3 turns unstable there (3.6B and 8B: at step 3), and
# from then on rounding differences between equally correct peers grow to the size of the
# loss's movement. Vanilla DDP on four H200s read 9.763 and 9.888 at 8B's step 4 in two runs of
# the same command (10.401 and 11.090 at step 5), where autooffload and vanilla of one run agreed
# within 0.013 at step 3.
# A stable run is compared to its end.
FIRST_TOL_ABS, FIRST_TOL_REL = 0.02, 0.002
FINAL_TOL_ABS, FINAL_TOL_DROP = 0.05, 0.10
CHECK_MIN_STEPS = 2

SUMMARY_NUMBERS = (
    "tokens_per_s",
    "step_s_median",
    "peak_allocated_gib",
    "peak_reserved_gib",
    "peak_timed_allocated_gib",
    "peak_timed_reserved_gib",
    "host_rss_peak_gib",
    "host_rss_total_gib",
    "loss_first",
    "loss_final",
    "mfu",
)


def _median(values: list[float]) -> float | None:
    values = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(values) if values else None


def _vanilla_reference(
    results: list[dict[str, Any]], workload: str, cap: str, nproc: int = 1, seq: int | None = None
) -> dict | None:
    """Median vanilla numbers for ``workload`` on ``nproc`` GPUs (vanilla DDP beside a
    multi-GPU peer, never the mean over GPU counts) at sequence length ``seq``: same cap if
    vanilla ran ok there, else its best cap."""
    ok = [r for r in results if r["workload"] == workload and r["peer"] == "vanilla"]
    ok = [r for r in ok if r.get("status") == "ok" and (r.get("nproc") or 1) == nproc]
    ok = [r for r in ok if r.get("seq") == seq]
    if not ok:
        return None
    same_cap = [r for r in ok if r["cap"] == cap]
    if same_cap:
        chosen = same_cap
    else:  # e.g. vanilla only fits uncapped: compare against its fastest cap
        by_cap: dict[str, list[dict]] = defaultdict(list)
        for r in ok:
            by_cap[r["cap"]].append(r)
        chosen = max(by_cap.values(), key=lambda rs: _median([r["tokens_per_s"] for r in rs]) or 0)
    ref = {k: _median([r.get(k) for r in chosen]) for k in SUMMARY_NUMBERS}
    ref["cap"] = chosen[0]["cap"]
    per_step = [r.get("losses") for r in chosen]
    if all(isinstance(losses, list) and losses for losses in per_step):
        length = min(len(losses) for losses in per_step)
        ref["losses"] = [_median([losses[i] for losses in per_step]) for i in range(length)]
    return ref


def check_window(ref_losses: list[float]) -> int:
    """How many leading steps the loss check compares: through vanilla's first rise by more
    than ``FINAL_TOL_ABS`` (the run turning unstable), at least ``CHECK_MIN_STEPS``."""
    for index in range(1, len(ref_losses)):
        if ref_losses[index] > ref_losses[index - 1] + FINAL_TOL_ABS:
            return min(len(ref_losses), max(CHECK_MIN_STEPS, index + 1))
    return len(ref_losses)


def loss_check(result: dict[str, Any], ref: dict[str, Any] | None) -> str:
    """ "ok", "DIFF first" / "DIFF step N" (beyond the tolerances above) or "n/a"; runs recorded
    without per-step losses compare the first and final losses ("DIFF final")."""
    if result.get("status") != "ok" or ref is None or ref.get("loss_final") is None:
        return "n/a"
    first_tol = FIRST_TOL_ABS + FIRST_TOL_REL * abs(ref["loss_first"])
    if abs(result["loss_first"] - ref["loss_first"]) > first_tol:
        return "DIFF first"
    ref_losses, losses = ref.get("losses"), result.get("losses")
    if not ref_losses or not isinstance(losses, list):
        drop = abs(ref["loss_first"] - ref["loss_final"])
        tol = max(FINAL_TOL_ABS, FINAL_TOL_DROP * drop)
        return "DIFF final" if abs(result["loss_final"] - ref["loss_final"]) > tol else "ok"
    largest_drop = 0.0
    for index in range(1, min(check_window(ref_losses), len(losses))):
        largest_drop = max(largest_drop, ref_losses[0] - ref_losses[index])
        tol = max(FINAL_TOL_ABS, FINAL_TOL_DROP * largest_drop)
        if abs(losses[index] - ref_losses[index]) > tol:
            return f"DIFF step {index + 1}"
    return "ok"


def smallest_peak_gib(run: dict[str, Any]) -> float | None:
    """The smallest predicted peak of a planned run's search (its frontier's first row, GiB):
    the least the planner expects this batch to need, whatever the cap."""
    frontier = (run.get("candidates") or {}).get("frontier") or []
    return min(row[0] for row in frontier) if frontier else None


def annotate(results: list[dict[str, Any]]) -> None:
    """Add ratios vs vanilla, ``loss_vs_vanilla`` and ``loss_check`` to each result, in place."""
    for result in results:
        nproc = result.get("nproc") or 1
        ref = _vanilla_reference(
            results, result["workload"], result["cap"], nproc, result.get("seq")
        )
        result["ref_cap"] = ref["cap"] if ref else None
        ok = result.get("status") == "ok" and ref is not None
        tput, ref_tput = result.get("tokens_per_s"), (ref or {}).get("tokens_per_s")
        result["tput_ratio"] = tput / ref_tput if ok and tput and ref_tput else None
        peak, ref_peak = result.get("peak_allocated_gib"), (ref or {}).get("peak_allocated_gib")
        result["mem_ratio"] = peak / ref_peak if ok and peak and ref_peak else None
        ref_loss = (ref or {}).get("loss_final")
        result["loss_vs_vanilla"] = result["loss_final"] - ref_loss if ok and ref_loss else None
        result["loss_check"] = loss_check(result, ref)
        ref_losses = (ref or {}).get("losses")
        result["loss_check_steps"] = check_window(ref_losses) if ok and ref_losses else None


def summarise(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (workload, its depth, sequence length, cap, peer label), medians over
    repeats, in first-seen order."""
    groups: dict[tuple[str, int | None, int | None, str, str], list[dict]] = {}
    for r in results:
        key = (r["workload"], r.get("layers"), r.get("seq"), r["cap"], r["peer_label"])
        groups.setdefault(key, []).append(r)
    rows = []
    for (workload, layers, seq, cap, label), runs in groups.items():
        ok = [r for r in runs if r.get("status") == "ok"]
        row: dict[str, Any] = {"workload": workload, "seq": seq, "cap": cap, "peer_label": label}
        row["layers"] = layers
        row["runs"] = len(runs)
        row["ok"] = len(ok)
        statuses = sorted({r.get("status", "?") for r in runs})
        row["status"] = "ok" if len(ok) == len(runs) else "/".join(statuses)
        failed = [r for r in runs if r.get("status") != "ok"]
        row["reason"] = failed[0].get("reason") if failed else None
        row["message"] = failure_message(failed[0]) if failed else None
        for key in (*SUMMARY_NUMBERS, "tput_ratio", "mem_ratio", "loss_vs_vanilla"):
            row[key] = _median([r.get(key) for r in ok])
        for key in ("predicted_peak", "predicted_allocated"):
            predicted = _median([r.get(f"{key}_bytes") for r in ok])
            row[f"{key}_gib"] = predicted / GiB if predicted is not None else None
        row["predicted_step_s"] = _median([r.get("predicted_step_s") for r in ok])
        row["smallest_peak_gib"] = _median([smallest_peak_gib(r) for r in ok])
        profiling = _median([r.get("profiling_peak_bytes") for r in ok])
        row["profiling_peak_gib"] = profiling / GiB if profiling is not None else None
        row["expandable_segments"] = bool(ok) and all(r.get("expandable_segments") for r in ok)
        _prediction_errors(row)
        checks = {r.get("loss_check") for r in ok}
        row["loss_check"] = "ok" if checks == {"ok"} else ",".join(sorted(c or "?" for c in checks))
        breakdown_keys = ("h2d_s", "d2h_s", "cpu_optim_s", "stall_s")
        row["breakdown"] = {
            k: _median([(r.get("breakdown") or {}).get(k) for r in ok]) for k in breakdown_keys
        }
        row["predicted_terms"] = {
            k: _median([(r.get("predicted_breakdown") or {}).get(k) for r in ok])
            for k, _ in PREDICTED_TERMS
        }
        row["timed_alloc_retries"] = _median([_timed_retries(r) for r in ok])
        # Estimated before the run, whatever its outcome.
        row["host_need_gib"] = _median([r.get("host_need_gib") for r in runs])
        row["nproc"] = max([r.get("nproc") or 1 for r in runs])
        row["sweep"] = runs[0].get("sweep")
        rows.append(row)
    rows = _with_sweep_best(rows)
    _scaling(rows)
    return rows


def is_sweep_configuration(row: dict[str, Any]) -> bool:
    """Whether ``row`` is one configuration of a peer's sweep (not the sweep's best row)."""
    return bool(row.get("sweep")) and not row.get("sweep_best")


def _with_sweep_best(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with, before the configurations of each sweep (workload, cap, GPU count), one
    row for the sweep: the fastest configuration that ran ok, or, when none fits, why."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        if is_sweep_configuration(row):
            groups.setdefault(sweep_key(row), []).append(row)
    out: list[dict[str, Any]] = []
    for row in rows:
        group = groups.get(sweep_key(row)) if is_sweep_configuration(row) else None
        if group and group[0] is row:
            out.append(_sweep_best(group, [r for r in rows if is_sweep_configuration(r)]))
        out.append(row)
    return out


def sweep_key(row: dict[str, Any]) -> tuple:
    """What the rows of one sweep share: workload, cap, GPU count, the sweeping peer and the
    sequence length."""
    return (row["workload"], row["cap"], row.get("nproc") or 1, row.get("sweep"), row.get("seq"))


def several_seqs(rows: list[dict[str, Any]]) -> bool:
    """Whether ``rows`` hold more than one sequence length (a ``--seq`` sweep)."""
    return len({row.get("seq") for row in rows}) > 1


def workload_label(row: dict[str, Any]) -> str:
    """A row's workload as tables name it: its name, with its block count where ``--layers``
    changed it (``llama-8b-lora (2 layers)``)."""
    from autooffload.bench.workloads import WORKLOADS

    name, layers = row["workload"], row.get("layers")
    named = WORKLOADS.get(name)
    if layers is None or named is None or named.text_dims["num_hidden_layers"] == layers:
        return name
    return f"{name} ({layers} layers)"


def where(row: dict[str, Any], with_seq: bool) -> str:
    """How notes name a row's workload: ``w``, or ``w seq 8192`` in a ``--seq`` sweep."""
    return workload_label(row) + (f" seq {row.get('seq')}" if with_seq else "")


def config_of(row: dict[str, Any]) -> str:
    """``stage=2,gc=True`` from ``deepspeed[stage=2,gc=True]`` (and its `` xN``)."""
    label = row["peer_label"]
    return label[label.find("[") + 1 : label.rfind("]")] if "[" in label else label


def _sweep_best(group: list[dict[str, Any]], every: list[dict[str, Any]]) -> dict[str, Any]:
    """The sweep's row: the fastest ok configuration's numbers, its configuration, the ones
    that ran out of memory or were not run for host memory and, when none fits, the least GPU
    memory a configuration needed at another cap of the same run (``need_gib``, ``need_cap``;
    None when none was measured), or, when the host could hold none, the least host memory
    one needs (the row is ``skipped`` with that reason)."""
    first = group[0]
    sweep, nproc = first["sweep"], first.get("nproc") or 1
    ok = [r for r in group if r["status"] == "ok" and r.get("tokens_per_s")]
    best = max(ok, key=lambda r: r["tokens_per_s"]) if ok else None
    row: dict[str, Any] = (
        dict(best)
        if best
        else {
            **{k: None for k in first if k not in ("workload", "seq", "cap", "nproc", "sweep")},
            "workload": first["workload"],
            "layers": first.get("layers"),
            "seq": first.get("seq"),
            "cap": first["cap"],
            "nproc": nproc,
            "breakdown": {k: None for k in first.get("breakdown") or {}},
            "predicted_terms": {k: None for k in first.get("predicted_terms") or {}},
        }
    )
    row["peer_label"] = sweep + (f" x{nproc}" if nproc > 1 else "")
    row["sweep"], row["sweep_best"] = sweep, True
    row["config"] = config_of(best) if best else None
    row["configs_oom"] = [config_of(r) for r in group if "OOM" in r["status"]]
    row["configs_run"] = sum(r["status"] != "skipped" for r in group)
    row["need_gib"] = row["need_cap"] = None
    host = [r for r in group if (r.get("message") or "").startswith(HOST_MEMORY_PREFIX)]
    row["configs_host_memory"] = [config_of(r) for r in host]
    if best is None and host and not row["configs_run"]:
        # The host cannot hold any: the least demanding one says by how much.
        least = min(host, key=lambda r: r.get("host_need_gib") or 0.0)
        row["status"], row["message"] = "skipped", least["message"]
        row["host_need_gib"] = least.get("host_need_gib")
        row["loss_check"] = "n/a"
    elif best is None:
        statuses = {r["status"] for r in group}
        row["status"] = "OOM" if row["configs_oom"] else "/".join(sorted(statuses))
        same = (first["workload"], nproc, sweep, first.get("seq"))
        # What a cap must hold: the whole run's reserved peak (set-up included).
        elsewhere = [
            r
            for r in every
            if (r["workload"], r.get("nproc") or 1, r.get("sweep"), r.get("seq")) == same
            and r["status"] == "ok"
            and r.get("peak_reserved_gib")
        ]
        if elsewhere:
            least = min(elsewhere, key=lambda r: r["peak_reserved_gib"])
            row["need_gib"], row["need_cap"] = least["peak_reserved_gib"], least["cap"]
        need = (
            f"; needs {row['need_gib']:.1f} GiB ([{config_of(least)}] at cap {least['cap']})"
            if elsewhere
            else "; the memory it needs was not measured"
        )
        skipped = f"; {len(host)} not run for host memory" if host else ""
        row["message"] = f"no configuration fits {first['cap']}{need}{skipped}"
        row["loss_check"] = "n/a"
    return row


def _timed_retries(run: dict[str, Any]) -> int | None:
    """The allocator's retries (cache emptied and device synchronised to fit a request) in the
    timed steps; None for runs recorded before the bench counted them."""
    per_step = run.get("step_alloc_retries")
    if per_step is None:
        return None
    return sum(per_step[run.get("warmup", 0) :])


def _error_pct(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured in percent: positive when over-predicted."""
    if predicted is None or not measured:
        return None
    return 100.0 * (predicted - measured) / measured


def _prediction_errors(row: dict[str, Any]) -> None:
    """Predicted vs measured: the peak (fragmentation included) against the memory the timed
    steps needed, the allocated bytes against their maximum (whole-run maxima when not
    recorded), and the step time against the median timed step.

    The need is ``profile_types.need_from_peaks``: the allocated maximum with the allocator's
    prior where the run had expandable segments (its reserved peak runs to the cap whatever
    the plan needs), else the reserved maximum."""
    reserved = row.get("peak_timed_reserved_gib") or row.get("peak_reserved_gib")
    row["measured_allocated_gib"] = row.get("peak_timed_allocated_gib") or row.get(
        "peak_allocated_gib"
    )
    allocated = row["measured_allocated_gib"]
    expandable = bool(row.get("expandable_segments") and allocated)
    row["measured_peak_gib"] = need_from_peaks(allocated, reserved, expandable)
    row["peak_err_pct"] = _error_pct(row["predicted_peak_gib"], row["measured_peak_gib"])
    row["alloc_err_pct"] = _error_pct(row["predicted_allocated_gib"], row["measured_allocated_gib"])
    row["step_err_pct"] = _error_pct(row["predicted_step_s"], row["step_s_median"])


# The plan's predicted step, term by term (``cost_time.predict_step_time``'s breakdown): compute and
# recompute, then the stalls each resource adds on top; with labels for the report.
PREDICTED_TERMS = (
    ("fwd_compute_s", "fwd compute"),
    ("bwd_compute_s", "bwd compute"),
    ("recompute_s", "recompute"),
    ("h2d_stall_s", "H2D stall"),
    ("d2h_stall_s", "D2H stall"),
    ("cpu_optim_stall_s", "CPU-update stall"),
    ("collective_stall_s", "all-reduce stall"),
    ("other_s", "other"),
)


def _scaling(rows: list[dict[str, Any]]) -> None:
    """``scaling``: a multi-GPU row's tok/s over N times its one-GPU row's (same cap, peer,
    sequence length)."""
    single = {
        (r["workload"], r.get("seq"), r["cap"], r["peer_label"]): r for r in rows if r["nproc"] == 1
    }
    for row in rows:
        n = row["nproc"]
        base_label = row["peer_label"].removesuffix(f" x{n}")
        base = single.get((row["workload"], row.get("seq"), row["cap"], base_label))
        ok = n > 1 and base and base.get("tokens_per_s") and row.get("tokens_per_s")
        row["scaling"] = row["tokens_per_s"] / (n * base["tokens_per_s"]) if ok else None


def build_payload(results: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """The JSON document: schema tag, run metadata, environment, every run and the summary."""
    annotate(results)
    env_source = next((r for r in results if r.get("versions")), {})
    environment = {
        "device_name": env_source.get("device_name"),
        "versions": env_source.get("versions"),
    }
    tolerances = {
        "first_abs": FIRST_TOL_ABS,
        "first_rel": FIRST_TOL_REL,
        "final_abs": FINAL_TOL_ABS,
        "final_frac_of_drop": FINAL_TOL_DROP,
        "window_min_steps": CHECK_MIN_STEPS,
    }
    return {
        "schema": SCHEMA,
        **meta,
        "environment": environment,
        "loss_tolerance": tolerances,
        "runs": results,
        "summary": summarise(results),
    }


def workload_meta(workload: Any) -> dict[str, Any]:
    """What the JSON records about a workload: its batch shape, mode and model dims."""
    return {
        "description": workload.description,
        "mode": workload.mode,
        "arch": workload.arch,
        "bs": workload.bs,
        "seq": workload.seq,
        "gc": workload.gc,
        "accum": workload.accum,
        "dtype": workload.dtype,
        "approx_params": workload.approx_params(),
        "text_dims": workload.text_dims,
        "vision_dims": workload.vision_dims or None,
    }


def build_payload_from_files(paths: list[Path]) -> dict[str, Any]:
    """Re-read one or more results files as one: runs in file order, annotations and summary
    recomputed; the first file's metadata, with every file's command, date and workloads."""
    payloads = [json.loads(Path(path).read_text()) for path in paths]
    skip = ("runs", "summary", "environment")
    meta = {k: v for k, v in payloads[0].items() if k not in skip}
    if len(payloads) > 1:
        meta["command"] = " ; ".join(p.get("command", "") for p in payloads)
        meta["workloads"] = {k: v for p in payloads for k, v in p.get("workloads", {}).items()}
        meta["merged_from"] = [
            {"file": Path(path).name, "command": p.get("command"), "date": p.get("date")}
            for path, p in zip(paths, payloads)
        ]
    return build_payload(_qualify_shapes([run for p in payloads for run in p["runs"]]), meta)


def _qualify_shapes(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs of one workload at different batch shapes (``--bs``/``--gc``/``--accum`` overrides in
    the merged files) get the shape in their workload name, so the summary never pools them.
    The sequence length is not part of it: summary rows are per length already, and files of
    one workload at several lengths merge into a ``--seq`` sweep."""
    shapes: dict[str, set[tuple]] = {}
    for run in runs:
        shapes.setdefault(run["workload"], set()).add(_shape(run))
    return [
        {
            **run,
            "workload": f"{run['workload']} bs{run.get('bs')}"
            + ("" if run.get("gc") is None else (" gc" if run["gc"] else " no-gc"))
            + (f" accum{run['accum']}" if (run.get("accum") or 1) > 1 else ""),
        }
        if len(shapes[run["workload"]]) > 1
        else run
        for run in runs
    ]


def _shape(run: dict[str, Any]) -> tuple:
    return (run.get("bs"), run.get("gc"), run.get("accum") or 1)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``path`` atomically (parents created)."""
    write_text_atomic(path, json.dumps(payload, indent=1, default=str))
