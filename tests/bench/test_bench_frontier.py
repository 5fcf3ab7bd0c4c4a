"""The planner's candidates in bench results: the summary, the error columns, the frontier plot."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from autooffload.bench import report
from autooffload.bench.__main__ import main
from autooffload.bench.frontier import MAX_OTHERS, REL_TOL, plot_frontier, summarise_candidates
from autooffload.bench.table import format_table
from autooffload.plan.profile_types import EXPANDABLE_FRAGMENTATION
from autooffload.plan.search import Candidates

GiB = 1 << 30
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TOKENS = 4096


def synthetic_candidates(n: int, budget_gib: float, seed: int = 0) -> Candidates:
    """``n`` configurations under ``budget_gib``: more memory buys speed, with scatter above it."""
    rng = np.random.default_rng(seed)
    peak_gib = rng.uniform(2.0, budget_gib, n)
    step_s = 1.0 / peak_gib + rng.exponential(0.05, n)
    knobs = [rng.integers(0, 20, n) for _ in range(4)]
    peak = (peak_gib * GiB).astype(np.int64)
    return Candidates(
        np.full(n, 64 << 20), *knobs, peak, step_s, TOKENS / step_s
    )  # chunk_size, n_persist, n_buffer, n_swap, n_checkpoint, peak, step, tokens/s


def plan_of(found: Candidates, row: int, budget_gib: float | None) -> SimpleNamespace:
    """A Plan stand-in for candidate ``row`` (what ``summarise_candidates`` reads)."""
    return SimpleNamespace(
        predicted_peak_bytes=int(found.peak_bytes[row]),
        predicted_step_s=float(found.step_s[row]),
        n_persist=int(found.n_persist[row]),
        n_buffer=int(found.n_buffer[row]),
        n_swap=int(found.n_swap[row]),
        n_checkpoint=int(found.n_checkpoint[row]),
        budget_bytes=int(budget_gib * GiB) if budget_gib else None,
    )


def test_summary_has_the_frontier_a_bounded_sample_and_the_chosen_plan() -> None:
    found = synthetic_candidates(5000, 12.0)
    fastest = int(np.argmin(found.step_s))
    summary = summarise_candidates(found, plan_of(found, fastest, 12.0), TOKENS)
    assert summary["count"] == 5000
    assert summary["budget_gib"] == pytest.approx(12.0)
    assert 0 < len(summary["others"]) <= MAX_OTHERS
    assert summary["columns"][:2] == ["peak_gib", "tokens_per_s"]
    frontier = np.array([row[:2] for row in summary["frontier"]])
    assert len(frontier) == summary["frontier_count"] == len(found.frontier())
    # Non-dominated: along increasing peak, throughput strictly increases...
    assert (np.diff(frontier[:, 0]) >= 0).all() and (np.diff(frontier[:, 1]) > 0).all()
    # ...and no feasible configuration is both smaller and faster than a frontier row.
    tput = TOKENS / found.step_s
    for peak_gib, row_tput in frontier:
        smaller = found.peak_bytes / GiB <= peak_gib - 1e-4  # rows are rounded to 1e-4 GiB
        assert not (tput[smaller] > row_tput * (1 + 1e-6)).any()
    chosen = summary["chosen"]
    assert chosen[:2] == [round(found.peak_bytes[fastest] / GiB, 4), round(tput[fastest], 1)]
    assert chosen[1] == pytest.approx(frontier[-1, 1])  # the fastest is the frontier's end
    assert summary["chosen_on_frontier"] is True and summary["frontier_gain"] == 0.0
    json.dumps(summary)  # JSON-ready as it is


def test_a_dominated_plan_is_flagged_off_the_frontier() -> None:
    found = synthetic_candidates(400, 10.0, seed=1)
    frontier = set(found.frontier().tolist())
    dominated = next(i for i in np.argsort(found.step_s)[::-1] if i not in frontier)
    plan = plan_of(found, int(dominated), 10.0)
    summary = summarise_candidates(found, plan, TOKENS)
    assert summary["chosen_on_frontier"] is False
    # The gain: the fastest row no larger than the plan, against the plan's step.
    no_larger = found.peak_bytes <= plan.predicted_peak_bytes * (1 + REL_TOL)
    best = found.step_s[no_larger].min()
    assert summary["frontier_gain"] == pytest.approx(1 - best / plan.predicted_step_s)
    assert summary["frontier_gain"] > 0


def planned_run(cap_gib: float, seed: int, measured: dict | None = None) -> dict:
    """An ok autooffload run at ``cap_gib`` whose plan is the fastest of its candidates."""
    found = synthetic_candidates(2000, cap_gib * 0.96, seed)
    best = int(np.argmin(found.step_s))
    summary = summarise_candidates(found, plan_of(found, best, cap_gib * 0.96), TOKENS)
    pred_step = float(found.step_s[best])
    run = {
        "workload": "w",
        "peer": "autooffload",
        "peer_label": "autooffload",
        "cap": f"{cap_gib:g}GiB",
        "status": "ok",
        "tokens_per_s": TOKENS / (pred_step * 1.1),
        "step_s_median": pred_step * 1.1,
        "peak_allocated_gib": cap_gib * 0.8,
        "peak_reserved_gib": cap_gib * 0.9,
        "peak_timed_allocated_gib": cap_gib * 0.8,
        "peak_timed_reserved_gib": cap_gib * 0.9,
        "host_rss_peak_gib": 1.0,
        "loss_first": 10.0,
        "loss_final": 8.0,
        "predicted_peak_bytes": int(found.peak_bytes[best]),
        "predicted_allocated_bytes": int(found.peak_bytes[best] / 1.1),
        "predicted_step_s": pred_step,
        "candidates": summary,
    }
    run.update(measured or {})
    return run


def test_table_shows_predicted_vs_measured_with_error_percentages() -> None:
    run = planned_run(12.0, 0)
    run.update(
        predicted_peak_bytes=int(10.5 * GiB),
        peak_timed_reserved_gib=10.0,
        peak_reserved_gib=11.0,  # whole run: the profiling steps reserved more
        predicted_allocated_bytes=int(9.0 * GiB),
        peak_timed_allocated_gib=10.0,
        predicted_step_s=0.9,
        step_s_median=1.0,
    )
    rows = report.summarise([run])
    assert rows[0]["peak_err_pct"] == pytest.approx(5.0)
    assert rows[0]["alloc_err_pct"] == pytest.approx(-10.0)
    assert rows[0]["step_err_pct"] == pytest.approx(-10.0)
    table = format_table(rows).splitlines()
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    cells = [cell.strip() for cell in table[2].strip("|").split("|")]
    assert len(cells) == len(header)
    row = dict(zip(header, cells))
    assert row["peak err %"] == "+5.0"
    assert row["pred peak / meas need GiB"] == "10.50 / 10.00"
    assert row["alloc err %"] == "-10.0"
    assert row["pred / meas alloc GiB"] == "9.00 / 10.00"
    assert (row["step ms"], row["pred step ms"], row["step err %"]) == ("1000", "900", "-10.0")
    notes = "\n".join(table)
    assert "peak vs need: +5.0% .. +5.0%" in notes
    assert "within +-5%: 1 of 1" in notes and "within +-15%: 1 of 1" in notes


def test_under_expandable_segments_the_peak_is_checked_against_the_allocated_need() -> None:
    """The reserved peak runs to the cap whatever the plan needs; under expandable segments the
    need is the allocated maximum times the allocator's prior."""
    run = planned_run(24.0, 0)
    run.update(
        expandable_segments=True,
        predicted_peak_bytes=int(20.6 * GiB),
        peak_timed_reserved_gib=23.97,
        peak_timed_allocated_gib=20.0,
    )
    (row,) = report.summarise([run])
    assert row["measured_peak_gib"] == pytest.approx(20.0 * EXPANDABLE_FRAGMENTATION)
    assert row["peak_err_pct"] == pytest.approx(0.0, abs=1e-6)
    run["expandable_segments"] = False
    (row,) = report.summarise([run])
    assert row["measured_peak_gib"] == pytest.approx(23.97)


def test_errors_fall_back_to_whole_run_peaks_and_skip_unplanned_peers() -> None:
    run = planned_run(8.0, 0)
    del run["peak_timed_reserved_gib"], run["peak_timed_allocated_gib"]  # an older result
    run.update(predicted_peak_bytes=int(7.92 * GiB), peak_reserved_gib=7.2)
    vanilla = {**planned_run(8.0, 1), "peer": "vanilla", "peer_label": "vanilla"}
    for key in ("predicted_peak_bytes", "predicted_allocated_bytes", "predicted_step_s"):
        vanilla.pop(key)
    planned, plain = report.summarise([run, vanilla])
    assert planned["peak_err_pct"] == pytest.approx(10.0)
    assert plain["peak_err_pct"] is None and plain["step_err_pct"] is None


def sweep_runs() -> list[dict]:
    runs = [planned_run(cap, seed) for seed, cap in enumerate((8.0, 12.0, 16.0, 24.0))]
    runs.append(
        {
            **planned_run(48.0, 9),
            "peer": "vanilla",
            "peer_label": "vanilla",
            "candidates": None,
            "predicted_peak_bytes": None,
        }
    )
    oom = {"workload": "w", "peer": "autooffload", "peer_label": "autooffload", "cap": "4GiB"}
    runs.append({**oom, "status": "OOM", "reason": "PlanError: x", "message": "PlanError: x"})
    return runs


def test_frontier_plot_of_a_sweep_is_a_png(tmp_path: Path) -> None:
    runs = sweep_runs()
    report.annotate(runs)
    rows = report.summarise(runs)
    path = tmp_path / "sweep.frontier.png"
    assert plot_frontier(runs, rows, path, "title")
    assert path.read_bytes()[:8] == PNG_MAGIC
    no_candidates = [{**r, "candidates": None} for r in runs]
    assert not plot_frontier(no_candidates, rows, tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_from_json_merges_files_and_writes_both_plots(tmp_path: Path, capsys) -> None:
    runs = sweep_runs()
    parts = []
    for index, chunk in enumerate((runs[:2], runs[2:])):
        path = tmp_path / f"part{index}.json"
        meta = {"command": f"python -m autooffload.bench part{index}", "workloads": {}}
        report.write_json(path, report.build_payload(chunk, meta))
        parts.append(str(path))
    out = tmp_path / "merged.json"
    assert main(["--from-json", ",".join(parts), "--out", str(out), "--plot"]) == 0
    merged = json.loads(out.read_text())
    assert len(merged["runs"]) == len(runs)
    assert [p["file"] for p in merged["merged_from"]] == ["part0.json", "part1.json"]
    assert {r["cap"] for r in merged["summary"]} == {
        "4GiB",
        "8GiB",
        "12GiB",
        "16GiB",
        "24GiB",
        "48GiB",
    }
    for png in (out.with_suffix(".png"), out.with_suffix(".frontier.png")):
        assert png.read_bytes()[:8] == PNG_MAGIC
    printed = capsys.readouterr().out
    assert "failed runs (OOM, nothing fits, errors): 1 of 5; w / 4GiB: OOM" in printed


def test_from_json_keeps_one_workload_at_two_shapes_apart(tmp_path: Path) -> None:
    runs = sweep_runs()[:2]
    parts = []
    for index, bs in enumerate((1, 4)):
        path = tmp_path / f"bs{bs}.json"
        chunk = [{**r, "bs": bs, "tokens_per_s": 1000.0 * (index + 1)} for r in runs]
        report.write_json(path, report.build_payload(chunk, {"workloads": {}}))
        parts.append(path)
    merged = report.build_payload_from_files(parts)
    names = {r["workload"] for r in merged["summary"]}
    assert len(names) == 2 and all("bs1" in n or "bs4" in n for n in names)
    same_name = report.build_payload_from_files([parts[0], parts[0]])
    assert {r["workload"] for r in same_name["summary"]} == {runs[0]["workload"]}


def test_from_json_merges_one_workload_at_two_lengths_into_a_seq_sweep(tmp_path: Path) -> None:
    """Summary rows are per sequence length: files at two lengths merge into one sweep, under the
    workload's own name, never pooled."""
    runs = sweep_runs()[:2]
    parts = []
    for index, seq in enumerate((8192, 16384)):
        path = tmp_path / f"seq{seq}.json"
        chunk = [{**r, "seq": seq, "tokens_per_s": 1000.0 * (index + 1)} for r in runs]
        report.write_json(path, report.build_payload(chunk, {"workloads": {}}))
        parts.append(path)
    merged = report.build_payload_from_files(parts)
    assert {r["workload"] for r in merged["summary"]} == {runs[0]["workload"]}
    by_seq = {(r["seq"], r["peer_label"]): r["tokens_per_s"] for r in merged["summary"]}
    assert by_seq[(8192, runs[0]["peer_label"])] == 1000.0
    assert by_seq[(16384, runs[0]["peer_label"])] == 2000.0


def test_the_report_says_where_the_predicted_step_goes() -> None:
    terms = {
        "fwd_compute_s": 0.2,
        "bwd_compute_s": 0.4,
        "recompute_s": 0.15,
        "h2d_stall_s": 0.05,
        "d2h_stall_s": 0.0,
        "cpu_optim_stall_s": 0.1,
        "other_s": 0.01,
    }
    run = planned_run(12.0, 0)
    run.update(predicted_step_s=0.91, step_s_median=1.0, predicted_breakdown=terms)
    older = {**planned_run(16.0, 1), "predicted_breakdown": None}  # a JSON from before
    text = format_table(report.summarise([run, older]))
    lines = text.split("Where the predicted step goes")[1].split("\n\n")[0].splitlines()[1:]
    assert lines == [
        "- w / 12GiB / autooffload: predicted 910 ms (fwd compute 200, bwd compute 400,"
        " recompute 150, H2D stall 50, CPU-update stall 100, other 10); measured 1000 ms"
    ], lines


def test_the_report_names_the_smallest_predicted_peak_and_the_cap_it_needs() -> None:
    """The search's smallest predicted peak (its frontier's first row) and the cap that leaves
    the planner that much (the budget's margin: 4%, at least 256 MiB), beside the profiling
    steps' own peak; a run without candidates (an older JSON, a fixed plan) has no line."""
    from autooffload.runtime.control.planning import cap_for_peak

    assert cap_for_peak(1 * GiB) == 1 * GiB + (256 << 20)
    assert cap_for_peak(20 * GiB) == math.ceil(20 * GiB / 0.96)
    run = planned_run(12.0, 0)
    smallest = min(row[0] for row in run["candidates"]["frontier"])
    assert smallest == min(run["candidates"]["frontier"], key=lambda row: row[0])[0] > 0
    run["profiling_peak_bytes"] = int(9.5 * GiB)
    without = {**planned_run(16.0, 1), "candidates": None}
    rows = report.summarise([run, without])
    assert rows[0]["smallest_peak_gib"] == pytest.approx(smallest)
    assert rows[1]["smallest_peak_gib"] is None
    lines = format_table(rows).split("Smallest predicted peak")[1].splitlines()[1:]
    cap = cap_for_peak(int(smallest * GiB)) / GiB
    assert lines == [
        f"- w / 12GiB / autooffload: {smallest:.2f} GiB, a cap of {cap:.2f} GiB;"
        " its profiling steps 9.50 GiB reserved"
    ], lines
