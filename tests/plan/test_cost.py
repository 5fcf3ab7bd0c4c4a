"""The cost model: each knob moves peak memory and step time the way the runtime does."""

from __future__ import annotations

from dataclasses import replace

import pytest
from plan_profiles import MiB, make_hardware, make_profile

from autooffload.errors import PlanError
from autooffload.plan.cost import (
    assign_block_policies,
    calibrate,
    chunk_tables,
    peak_breakdown,
    predict_peak_bytes,
    predict_step_time,
)
from autooffload.plan.types import Knobs


def _knobs(profile, **changes) -> Knobs:
    """A valid middle-of-the-road configuration, with ``changes`` applied."""
    tables = chunk_tables(profile)
    n_persist = changes.pop("n_persist", profile.n_chunks // 3)
    n_buffer = changes.pop("n_buffer", int(tables.min_buffers[n_persist]))
    return Knobs(n_persist, n_buffer, **changes)


def _time(profile, hw, knobs):
    return predict_step_time(profile, hw, knobs)


def test_more_persistent_chunks_cost_memory_and_save_traffic(profile, hw):
    tables = chunk_tables(profile)
    peaks, h2d, d2h, cpu_work, time_without_gpu_optim = [], [], [], [], []
    for n_persist in range(profile.n_chunks + 1):
        knobs = Knobs(n_persist, int(tables.useful_buffers.max()))
        step, breakdown, _ = _time(profile, hw, knobs)
        peaks.append(predict_peak_bytes(profile, hw, knobs))
        h2d.append(breakdown["h2d_bytes"])
        d2h.append(breakdown["d2h_bytes"])
        cpu_work.append(breakdown["cpu_optim_s"])
        time_without_gpu_optim.append(step - breakdown["gpu_optim_s"])
    assert peaks == sorted(peaks) and peaks[-1] > peaks[0]
    assert h2d == sorted(h2d, reverse=True) and h2d[-1] == 0 < h2d[0]
    assert d2h == sorted(d2h, reverse=True) and d2h[-1] == 0
    assert cpu_work == sorted(cpu_work, reverse=True) and cpu_work[-1] == 0
    diffs = [b - a for a, b in zip(time_without_gpu_optim, time_without_gpu_optim[1:])]
    assert max(diffs) <= 1e-12


def test_more_buffers_cost_memory_and_never_slow_down(profile):
    hw = make_hardware(h2d_bps=4e9, d2h_bps=4e9, duplex_bps=7e9)  # PCIe-bound: prefetch matters
    tables = chunk_tables(profile)
    low = int(tables.min_buffers[0])
    results = [
        (predict_peak_bytes(profile, hw, Knobs(0, b)), _time(profile, hw, Knobs(0, b))[0])
        for b in range(low, low + 5)
    ]
    peaks, times = zip(*results)
    assert list(peaks) == sorted(peaks) and peaks[-1] - peaks[0] >= 4 * profile.chunk_size
    assert list(times) == sorted(times, reverse=True) and times[0] > times[-1]


def test_one_buffer_too_few_is_rejected_with_the_minimum(profile, hw):
    low = int(chunk_tables(profile).min_buffers[0])
    with pytest.raises(PlanError, match=f"n_buffer={low - 1}.*n_buffer >= {low}"):
        predict_peak_bytes(profile, hw, Knobs(0, low - 1))


def test_more_checkpointing_saves_memory_and_costs_recompute(profile, hw):
    rows = []
    for n_checkpoint in range(profile.n_blocks + 1):
        knobs = _knobs(profile, n_checkpoint=n_checkpoint)
        step, breakdown, _ = _time(profile, hw, knobs)
        rows.append((predict_peak_bytes(profile, hw, knobs), step, breakdown["recompute_s"]))
    peaks, times, recompute = zip(*rows)
    assert list(peaks) == sorted(peaks, reverse=True) and peaks[0] > peaks[-1]
    assert list(times) == sorted(times) and times[-1] > times[0]
    assert recompute[0] == 0 and recompute[-1] == pytest.approx(
        sum(b.fwd_s for b in profile.blocks)
    )


def test_more_swapping_saves_memory_and_adds_pcie_traffic(profile, hw):
    rows = []
    for n_swap in range(profile.n_blocks + 1):
        knobs = _knobs(profile, n_swap=n_swap)
        _, breakdown, _ = _time(profile, hw, knobs)
        rows.append((predict_peak_bytes(profile, hw, knobs), breakdown["swap_bytes"]))
    peaks, swap_bytes = zip(*rows)
    assert list(peaks) == sorted(peaks, reverse=True) and peaks[0] > peaks[-1]
    expected = 2 * sum(b.act_bytes_keep for b in profile.blocks)  # out in forward, back in backward
    assert swap_bytes[0] == 0 and 2 * swap_bytes[-1] == expected


def test_swap_traffic_shares_pcie_with_chunk_traffic(profile):
    slow = make_hardware(h2d_bps=2e9, d2h_bps=2e9, duplex_bps=3e9)
    all_swap = _knobs(profile, n_persist=0, n_swap=profile.n_blocks)
    keep, _, _ = _time(profile, slow, _knobs(profile, n_persist=0))
    swapped, breakdown, bottleneck = _time(profile, slow, all_swap)
    assert swapped > keep and bottleneck.startswith("pcie")
    # With everything persistent the same swap traffic has the link to itself: less stall.
    alone, alone_breakdown, _ = _time(
        profile, slow, _knobs(profile, n_persist=profile.n_chunks, n_swap=profile.n_blocks)
    )
    assert alone_breakdown["h2d_stall_s"] < breakdown["h2d_stall_s"]


def test_slow_cpu_optimizer_stalls_the_next_forward(profile):
    fast = make_hardware()
    slow = make_hardware(cpu_optim_params_per_s=1e7)
    knobs = _knobs(profile, n_persist=0)
    fast_step, fast_breakdown, _ = _time(profile, fast, knobs)
    slow_step, slow_breakdown, bottleneck = _time(profile, slow, knobs)
    assert fast_breakdown["cpu_optim_stall_s"] < 0.05 * slow_breakdown["cpu_optim_stall_s"]
    assert bottleneck == "cpu_optimizer"
    # The update of all offloaded params (minus what the forward hides) is on the critical path.
    assert slow_step - fast_step == pytest.approx(slow_breakdown["cpu_optim_stall_s"], rel=0.05)
    assert slow_breakdown["cpu_optim_stall_s"] > 0.5 * slow_breakdown["cpu_optim_s"]


def test_fast_links_make_the_step_compute_bound(profile, hw):
    knobs = _knobs(profile)
    step, breakdown, bottleneck = _time(profile, hw, knobs)
    compute = breakdown["fwd_compute_s"] + breakdown["bwd_compute_s"] + profile.other_s
    assert bottleneck == "compute"
    assert compute <= step <= 1.05 * compute + breakdown["gpu_optim_s"]


def test_logits_transient_and_context_and_fragmentation_enter_the_peak(profile, hw):
    knobs = _knobs(profile)
    base = peak_breakdown(profile, hw, knobs)
    bigger_loss = replace(
        profile, post=replace(profile.post, fwd_transient_bytes=4096 * MiB)
    )  # e.g. a 128k vocabulary's fp32 logits
    grown = peak_breakdown(bigger_loss, hw, knobs)
    assert grown["peak"] > base["peak"] + 3 * 1024 * MiB
    assert grown["peak"] == hw.cuda_context_bytes + -(-grown["allocated"] * 1.1 // 1)
    with_context = predict_peak_bytes(profile, replace(hw, cuda_context_bytes=0), knobs)
    assert base["peak"] - with_context == hw.cuda_context_bytes
    fragmented = predict_peak_bytes(profile.with_fragmentation(1.5), hw, knobs)
    assert fragmented - hw.cuda_context_bytes == pytest.approx(1.5 * base["allocated"], abs=1)


def test_calibrate_recovers_the_measured_fragmentation(profile, hw):
    knobs = _knobs(profile)
    predicted = predict_peak_bytes(profile, hw, knobs)
    allocated = peak_breakdown(profile, hw, knobs)["allocated"]
    measured = hw.cuda_context_bytes + int(1.3 * allocated)
    factor = calibrate(profile, measured, predicted, hw.cuda_context_bytes)
    assert factor == pytest.approx(1.3, rel=1e-6)
    recalibrated = predict_peak_bytes(profile.with_fragmentation(factor), hw, knobs)
    assert recalibrated == pytest.approx(measured, rel=1e-6)
    assert calibrate(profile, predicted, predicted, hw.cuda_context_bytes) == pytest.approx(1.1)
    assert calibrate(profile, hw.cuda_context_bytes + 1, predicted, hw.cuda_context_bytes) == 1.0
    with pytest.raises(PlanError, match="cuda_context_bytes"):
        calibrate(profile, measured, 10, hw.cuda_context_bytes)


def test_fragmentation_is_per_weight_dtype():
    profile = make_profile()
    nf4 = replace(profile, weight_dtype="nf4")
    assert nf4.fragmentation_factor > profile.fragmentation_factor
    calibrated = profile.with_fragmentation(1.02)
    assert calibrated.fragmentation_factor == 1.02
    assert replace(calibrated, weight_dtype="nf4").fragmentation_factor == nf4.fragmentation_factor


def test_block_policy_rule_swaps_first_then_checkpoints_and_is_nested():
    assert assign_block_policies(6, 2, 3) == (
        "swap", "swap", "checkpoint", "checkpoint", "checkpoint", "keep"
    )  # fmt: skip
    for n_checkpoint in range(4):
        fewer = assign_block_policies(6, 2, n_checkpoint)
        more = assign_block_policies(6, 2, n_checkpoint + 1)
        assert sum(a != b for a, b in zip(fewer, more)) == 1
    with pytest.raises(PlanError, match="n_swap=4 \\+ n_checkpoint=3"):
        assign_block_policies(6, 4, 3)


def test_frozen_chunks_are_gathered_but_send_no_grads(hw):
    lora = make_profile(lora=True)
    knobs = _knobs(lora, n_persist=0)
    _, breakdown, _ = _time(lora, hw, knobs)
    assert breakdown["h2d_bytes"] > 0
    assert breakdown["d2h_bytes"] == 0 and breakdown["cpu_optim_s"] == 0
    full = make_profile()
    assert predict_peak_bytes(lora, hw, knobs) < predict_peak_bytes(full, hw, knobs)


def test_tied_embeddings_are_gathered_again_for_the_head(hw):
    tied = make_profile(tied=True)
    tables = chunk_tables(tied)
    head = tied.n_units - 1
    assert tables.fwd_gather_count[0, head] >= 1  # chunk 0 comes back for the head
    assert tables.fwd_gather_count[1, head] == 0  # unless it is persistent
    assert predict_peak_bytes(tied, hw, _knobs(tied, n_persist=0)) > 0
