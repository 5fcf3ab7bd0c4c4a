"""The bench's PNG plots: throughput per peer against the cap, tokens/s against the number of
GPUs, tokens/s and peak memory against the sequence length, and (``frontier.py``) the planner's
throughput-memory frontier."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from autooffload.atomic import atomic_write
from autooffload.bench.cli_values import parse_size
from autooffload.bench.frontier import plot_frontier
from autooffload.bench.report import GiB, is_sweep_configuration, several_seqs, where
from autooffload.bench.table import fmt


def write_plots(payload: dict[str, Any], path: Path, title: str = "") -> list[Path]:
    """The throughput plot at ``path`` and beside it, when the runs call for them: the
    throughput-vs-memory frontier (``NAME.frontier.png``: runs recorded the planner's
    candidates), the scaling plot (``NAME.scaling.png``: several GPU counts) and the
    sequence-length plot (``NAME.seq.png``: a ``--seq`` sweep); the paths written."""
    plot(payload["summary"], path, title)
    written = [Path(path)]
    frontier_path = Path(path).with_suffix(".frontier.png")
    if plot_frontier(payload["runs"], payload["summary"], frontier_path, title):
        written.append(frontier_path)
    scaling_path = Path(path).with_suffix(".scaling.png")
    if plot_scaling(payload["summary"], scaling_path, title):
        written.append(scaling_path)
    seq_path = Path(path).with_suffix(".seq.png")
    if plot_seq(payload["summary"], seq_path, title):
        written.append(seq_path)
    return written


def plot_scaling(rows: list[dict[str, Any]], path: Path, title: str = "") -> bool:
    """PNG: tokens/s against the number of GPUs, one line per peer and cap, one panel per
    workload (and sequence length, in a ``--seq`` sweep) run on more than one GPU count (the
    dotted line: perfect scaling from one GPU). False (nothing written) when no workload ran on
    several GPU counts."""
    with_seq = several_seqs(rows)
    rows = [r for r in rows if not is_sweep_configuration(r) and r.get("tokens_per_s")]
    counts: dict[str, set[int]] = defaultdict(set)
    for row in rows:
        counts[where(row, with_seq)].add(row.get("nproc") or 1)
    workloads = [w for w, n in counts.items() if len(n) > 1]
    if not workloads:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(workloads), figsize=(6.5 * len(workloads), 4.5), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        lines: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
        for row in rows:
            if where(row, with_seq) == workload:
                n = row.get("nproc") or 1
                label = row["peer_label"].removesuffix(f" x{n}")
                lines[(label, row["cap"])].append((n, row["tokens_per_s"]))
        for (label, cap), points in lines.items():
            points.sort()
            xs, ys = zip(*points)
            (line,) = ax.plot(xs, ys, "o-", label=f"{label} (cap {cap})")
            if xs[0] == 1:
                ax.plot(xs, [ys[0] * n for n in xs], ":", color=line.get_color())
        ax.set_title(workload)
        ax.set_xlabel("GPUs")
        ax.set_xticks(sorted(counts[workload]))
        ax.set_ylabel("tokens/s (median; dotted: linear from 1 GPU)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path, title, 110)
    return True


def plot(rows: list[dict[str, Any]], path: Path, title: str = "") -> None:
    """PNG: throughput vs cap per peer (several caps) or a bar per peer (one cap), per workload
    (per workload and sequence length in a ``--seq`` sweep)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_seq = several_seqs(rows)
    rows = [r for r in rows if not is_sweep_configuration(r)]
    workloads = list(dict.fromkeys(where(r, with_seq) for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(6.5 * len(workloads), 4.5), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        mine = [r for r in rows if where(r, with_seq) == workload]
        caps = list(dict.fromkeys(r["cap"] for r in mine))
        if len(caps) > 1:
            _plot_sweep(ax, mine, caps)
        else:
            _plot_bars(ax, mine)
        ax.set_title(f"{workload}" + (f" (cap {caps[0]})" if len(caps) == 1 else ""))
        ax.set_ylabel("tokens/s (median)")
        ax.grid(alpha=0.3)
    save_figure(fig, path, title, 110)


def plot_seq(rows: list[dict[str, Any]], path: Path, title: str = "") -> bool:
    """PNG: tokens/s (left) and peak allocated GiB (right) against the sequence length, one line
    per peer (and cap, when several), one row of panels per workload run at more than one
    length; a point whose runs all failed (OOM, error, skipped) is left out. False (nothing
    written) when no workload ran at several lengths."""
    rows = [r for r in rows if not is_sweep_configuration(r) and r.get("seq") is not None]
    lengths: dict[str, set[int]] = defaultdict(set)
    for row in rows:
        lengths[row["workload"]].add(row["seq"])
    workloads = [w for w, seqs in lengths.items() if len(seqs) > 1]
    if not workloads:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(workloads), 2, figsize=(13, 4.5 * len(workloads)), squeeze=False)
    for (ax_tput, ax_peak), workload in zip(axes, workloads):
        for label, points in seq_lines([r for r in rows if r["workload"] == workload]).items():
            xs = [r["seq"] for r in points]
            (line,) = ax_tput.plot(xs, [r["tokens_per_s"] for r in points], "o-", label=label)
            peaks = [(r["seq"], r.get("peak_allocated_gib")) for r in points]
            peaks = [(seq, peak) for seq, peak in peaks if peak]
            if peaks:
                ax_peak.plot(*zip(*peaks), "o-", color=line.get_color(), label=label)
        ticks = sorted(lengths[workload])
        for ax, what in ((ax_tput, "tokens/s (median)"), (ax_peak, "peak allocated GiB")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.minorticks_off()
            ax.set_xlabel("sequence length (tokens; OOM / failed points left out)")
            ax.set_ylabel(what)
            ax.set_title(f"{workload}: {what.split(' (')[0]} vs sequence length")
            ax.grid(alpha=0.3)
            if ax.get_lines():
                ax.legend(fontsize=8)
    save_figure(fig, path, title, 140)
    return True


def seq_lines(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The lines of one workload's sequence-length plot: per peer label (with ``(cap X)`` when
    the rows hold several caps), its rows that ran ok, shortest first."""
    several_caps = len({r["cap"] for r in rows}) > 1
    lines: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if row.get("tokens_per_s"):  # ran ok (the median over the repeats that did)
            label = row["peer_label"] + (f" (cap {row['cap']})" if several_caps else "")
            lines[label].append(row)
    return {label: sorted(points, key=lambda r: r["seq"]) for label, points in lines.items()}


def _cap_x(caps: list[str]) -> dict[str, float]:
    numeric = {c: parse_size(c) for c in caps}
    finite = [v / GiB for v in numeric.values() if v is not None]
    top = max(finite) if finite else 1.0
    return {c: (v / GiB if v is not None else top * 1.25) for c, v in numeric.items()}


def _plot_sweep(ax: Any, rows: list[dict[str, Any]], caps: list[str]) -> None:
    xs = _cap_x(caps)
    for label in dict.fromkeys(r["peer_label"] for r in rows):
        mine = sorted((r for r in rows if r["peer_label"] == label), key=lambda r: xs[r["cap"]])
        ok = [r for r in mine if r["tokens_per_s"] is not None]
        if not ok and all(r["status"] == "skipped" for r in mine):
            continue
        if [r["cap"] for r in mine] == ["none"] and ok:  # uncapped reference: a line across
            ax.axhline(ok[0]["tokens_per_s"], ls="--", color="gray", label=f"{label} (uncapped)")
            continue
        (line,) = ax.plot(
            [xs[r["cap"]] for r in ok], [r["tokens_per_s"] for r in ok], "o-", label=label
        )
        failed = [r for r in mine if r["tokens_per_s"] is None and r["status"] != "skipped"]
        if failed:
            ax.plot(
                [xs[r["cap"]] for r in failed], [0] * len(failed), "x", color=line.get_color(), ms=9
            )
    ax.set_xticks(sorted(xs.values()))
    ax.set_xticklabels([c for c, _ in sorted(xs.items(), key=lambda kv: kv[1])])
    ax.set_xlabel("GPU memory cap (x = OOM/error)")
    ax.legend(fontsize=8)


def _plot_bars(ax: Any, rows: list[dict[str, Any]]) -> None:
    labels = [r["peer_label"] for r in rows]
    values = [r["tokens_per_s"] or 0 for r in rows]
    bars = ax.bar(range(len(rows)), values, color="tab:blue")
    for bar, row in zip(bars, rows):
        text = (
            row["status"]
            if row["tokens_per_s"] is None
            else f"{fmt(row['peak_allocated_gib'])} GiB"
        )
        ax.annotate(
            text[:20],
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)


def save_figure(fig: Any, path: Path, title: str, title_width: int) -> None:
    """Title ``fig`` with the command (wrapped to three lines), write it as a PNG atomically,
    close it."""
    import matplotlib.pyplot as plt

    if title:
        import textwrap

        fig.suptitle("\n".join(textwrap.wrap(title, title_width, max_lines=3)), fontsize=8)
    fig.tight_layout()
    try:
        with atomic_write(path, "wb") as file:
            fig.savefig(file, format="png", dpi=110)
    finally:
        plt.close(fig)
