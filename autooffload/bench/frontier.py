"""The planner's feasible set in bench results: a compact summary per run, and its plot.

The worker summarises the search behind the autooffload peer's plan (``runtime.candidates()``):
the Pareto frontier, an evenly spaced sample of the other feasible configurations and the chosen
plan, each as predicted peak GiB, predicted tokens/s and knobs. ``plot_frontier`` draws them for
every cap of a sweep, with the measured points of every peer, so one can see that the plan is the
fastest feasible configuration and how far the measurement is from the prediction.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from autooffload.bench.cli_values import parse_size

if TYPE_CHECKING:
    from autooffload.plan.search import Candidates
    from autooffload.plan.types import Plan
    from autooffload.runtime.runtime import Runtime

GiB = 1 << 30
COLUMNS = ("peak_gib", "tokens_per_s", "n_persist", "n_buffer", "n_swap", "n_checkpoint")
MAX_FRONTIER = 300
MAX_OTHERS = 300
# The vectorised search and the plan's scalar prediction differ by float noise (~1e-12, a byte).
REL_TOL = 1e-9


def _spread(indices: np.ndarray, limit: int) -> np.ndarray:
    """At most ``limit`` of ``indices``, evenly spaced, the first and the last always kept."""
    if len(indices) <= limit:
        return indices
    picks = np.unique(np.linspace(0, len(indices) - 1, limit).round().astype(np.int64))
    return indices[picks]


def summarise_candidates(
    candidates: Candidates, plan: Plan, tokens_per_step: int, max_others: int = MAX_OTHERS
) -> dict[str, Any]:
    """A JSON-ready summary of the feasible set ``candidates`` around the chosen ``plan``.

    Throughput is ``tokens_per_step / predicted step`` (the bench's own token count, so that it
    compares with the measured tokens/s). ``frontier``: the Pareto rows by peak (at most
    ``MAX_FRONTIER``); ``others``: at most ``max_others`` of the rest, evenly spaced by peak;
    ``chosen``: the plan's row; ``chosen_on_frontier``: no feasible row is both smaller and faster;
    ``frontier_gain``: how much shorter the fastest row's step is than the plan's among the rows
    no larger than it (0 on the frontier; a calibration keeps a running plan unless another is
    ``replan.REPLAN_GAIN`` faster).
    """
    peak = np.asarray(candidates.peak_bytes, dtype=np.float64)
    step = np.asarray(candidates.step_s, dtype=np.float64)
    knobs = [np.asarray(getattr(candidates, name)) for name in COLUMNS[2:]]

    def rows(indices: np.ndarray) -> list[list[float]]:
        return [
            [
                round(peak[i] / GiB, 4),
                round(tokens_per_step / step[i], 1),
                *(int(k[i]) for k in knobs),
            ]
            for i in indices
        ]

    all_frontier = candidates.frontier() if len(step) else np.zeros(0, dtype=np.int64)
    rest = np.setdiff1d(np.arange(len(step)), all_frontier)
    rest = rest[np.argsort(peak[rest], kind="stable")]
    plan_peak = float(plan.predicted_peak_bytes)
    plan_step = float(plan.predicted_step_s)
    faster = step < plan_step * (1 - REL_TOL)
    no_slower = step <= plan_step * (1 + REL_TOL)
    smaller = peak < plan_peak * (1 - REL_TOL)
    no_larger = peak <= plan_peak * (1 + REL_TOL)
    dominated = (no_larger & faster) | (smaller & no_slower)
    chosen = [
        round(plan_peak / GiB, 4),
        round(tokens_per_step / plan_step, 1),
        int(plan.n_persist),
        int(plan.n_buffer),
        int(plan.n_swap),
        int(plan.n_checkpoint),
    ]
    budget = plan.budget_bytes
    return {
        "count": int(len(step)),
        "budget_gib": budget / GiB if budget is not None else None,
        "columns": list(COLUMNS),
        "frontier": rows(_spread(all_frontier, MAX_FRONTIER)),
        "frontier_count": int(len(all_frontier)),
        "others": rows(_spread(rest, max_others)),
        "chosen": chosen,
        "chosen_on_frontier": not bool(dominated.any()),
        "frontier_gain": float(max(0.0, 1.0 - step[no_larger].min() / plan_step))
        if no_larger.any()
        else 0.0,
    }


def candidates_of(
    runtime: Runtime | None, plan: Plan | None, tokens_per_step: int
) -> dict[str, Any] | None:
    """The summary of the search behind ``runtime``'s plan, timed; None when there was none."""
    list_candidates = getattr(runtime, "candidates", None)
    if runtime is None or plan is None or list_candidates is None:
        return None
    if plan.predicted_step_s is None or plan.predicted_peak_bytes is None:
        return None
    start = time.perf_counter()
    found = list_candidates()
    if found is None:
        return None
    summary = summarise_candidates(found, plan, tokens_per_step)
    summary["search_s"] = time.perf_counter() - start
    return summary


# --- plot -----------------------------------------------------------------------------------


def is_planned(label: str) -> bool:
    """The planned autooffload peer on one GPU (options allowed, fixed activation modes not)."""
    return label == "autooffload" or label.startswith("autooffload[")


def _sweeps(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per workload (per workload and sequence length in a ``--seq`` sweep), per cap: the first
    ok planned run with candidates."""
    from autooffload.bench.report import several_seqs, where

    with_seq = several_seqs(runs)
    found: dict[str, dict[str, dict[str, Any]]] = {}
    for run in runs:
        summary = run.get("candidates")
        if not is_planned(run.get("peer_label", "")) or run.get("status") != "ok":
            continue
        if not isinstance(summary, dict) or not summary.get("chosen"):
            continue
        found.setdefault(where(run, with_seq), {}).setdefault(run["cap"], run)
    return found


def _measured_peak(row: dict[str, Any]) -> float | None:
    """The measured counterpart of a predicted peak: reserved bytes in the timed steps."""
    for key in ("peak_timed_reserved_gib", "peak_reserved_gib", "peak_allocated_gib"):
        if row.get(key) is not None:
            return row[key]
    return None


def plot_frontier(
    runs: list[dict[str, Any]], rows: list[dict[str, Any]], path: Any, title: str = ""
) -> bool:
    """PNG, one panel per workload (per workload and length in a ``--seq`` sweep) with
    candidates: throughput vs GPU memory. Grey: feasible configurations (predicted); a step line
    per cap: its frontier; star: the chosen plan (predicted); circle: the run measured; other
    markers: the other peers measured. False (and nothing written) when no run recorded
    candidates."""
    from autooffload.bench.report import several_seqs, where

    sweeps = _sweeps(runs)
    if not sweeps:
        return False
    with_seq = several_seqs(runs)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = min(2, len(sweeps))
    nrows = (len(sweeps) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(7.5 * ncols, 5.2 * nrows), squeeze=False)
    for ax, (workload, by_cap) in zip(axes.flat, sweeps.items()):
        mine = [r for r in rows if where(r, with_seq) == workload]
        _plot_workload(ax, workload, by_cap, mine)
    for ax in list(axes.flat)[len(sweeps) :]:
        ax.set_visible(False)
    from autooffload.bench.plots import save_figure

    save_figure(fig, path, title, 140)
    return True


def _plot_workload(
    ax: Any, workload: str, by_cap: dict[str, dict[str, Any]], rows: list[dict[str, Any]]
) -> None:
    import matplotlib.pyplot as plt

    caps = sorted(by_cap, key=lambda c: by_cap[c]["candidates"].get("budget_gib") or np.inf)
    colors = plt.get_cmap("viridis")(np.linspace(0.0, 0.85, max(len(caps), 1)))
    summaries = [by_cap[cap]["candidates"] for cap in caps]
    grey = [(r[0], r[1]) for s in summaries for key in ("others", "frontier") for r in s[key]]
    if grey:
        ax.scatter(*zip(*grey), s=5, color="0.7", alpha=0.5, lw=0, label="feasible (predicted)")
    planned_label = by_cap[caps[0]]["peer_label"]
    medians = {r["cap"]: r for r in rows if r["peer_label"] == planned_label}
    predicted, measured = [], []
    for cap, color, summary in zip(caps, colors, summaries):
        front = sorted((r[0], r[1]) for r in summary["frontier"])
        if front:
            ax.step(*zip(*front), where="post", color=color, lw=1.2)
        if summary.get("budget_gib"):
            ax.axvline(summary["budget_gib"], color=color, ls=":", lw=0.9)
        ax.plot([], [], "s", color=color, label=f"cap {cap}: frontier, search budget (dotted)")
        chosen = summary["chosen"][:2]
        ax.plot(*chosen, "*", color=color, ms=14, mec="black", mew=0.6)
        predicted.append(tuple(chosen))
        run = medians.get(cap, by_cap[cap])
        peak, tput = _measured_peak(run), run.get("tokens_per_s")
        if peak is not None and tput:
            ax.plot(peak, tput, "o", color=color, ms=7, mec="black", mew=0.6)
            ax.plot([chosen[0], peak], [chosen[1], tput], color=color, lw=0.7)
            measured.append((peak, tput))
    ax.plot(*zip(*sorted(predicted)), "--", color="black", lw=0.8, label="plan, predicted (*)")
    if measured:
        ax.plot(*zip(*sorted(measured)), "-", color="tab:red", lw=1.2, label="plan, measured (o)")
    for row in rows:
        peak = _measured_peak(row)
        if row["peer_label"] == planned_label or not row.get("tokens_per_s") or peak is None:
            continue
        ax.plot(peak, row["tokens_per_s"], "P", ms=8, label=f"{row['peer_label']} @ {row['cap']}")
    for row in rows:  # a planned run that failed (OOM, nothing fits): a red x at its cap
        cap_bytes = parse_size(row["cap"])
        if row["peer_label"] != planned_label or row["status"] in ("ok", "skipped"):
            continue
        if cap_bytes is not None:
            ax.plot(cap_bytes / GiB, 0, "x", color="red", ms=10, mew=2, clip_on=False)
        ax.plot([], [], "x", color="red", label=f"{planned_label} @ {row['cap']}: {row['status']}")
    ax.set_title(f"{workload}: throughput vs GPU memory")
    ax.set_xlabel("GiB: predicted peak (grey, *) / max reserved in the timed steps (o, +)")
    ax.set_ylabel("tokens/s")
    ax.set_xlim(left=0)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.05)  # the fastest star sits at the top: keep it whole
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
