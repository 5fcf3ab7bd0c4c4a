"""The time model: the predicted step time of one configuration, window by window.

Notation and units as in ``plan/configuration.py``; ``docs/planner.md`` explains every term.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from autooffload.plan.configuration import accumulates_on_gpu, check_knobs, unit_policies
from autooffload.plan.profile_types import HardwareProfile, ModelProfile
from autooffload.plan.residency import (
    ChunkTables,
    chunk_spans,
    chunk_tables,
    prefetch_queue,
    transfer_s,
)
from autooffload.plan.types import Knobs, UpdatePlacement
from autooffload.plan.update_split import BackwardSplit, backward_split, update_split_row

# Below this share of the step, stalls and recompute are noise and the step is compute-bound.
BOTTLENECK_MIN_SHARE = 0.05


def prefetched_bytes(
    profile: ModelProfile, n_persist: int, unit: int, room: int, forward: bool
) -> int:
    """Bytes of the next unit's gathers that are prefetched while ``unit`` runs with ``room``
    free buffers: the front ``room`` chunks of ``prefetch_queue`` that the next unit (u+1 in
    forward, u-1 in backward) gathers. Chunks of one unit may differ in size (an oversized
    parameter's chunk beside small ones), so bytes are summed chunk by chunk."""
    first, last = chunk_spans(profile)
    ends, upcoming = (first, unit + 1) if forward else (last, unit - 1)
    queue = prefetch_queue(profile, n_persist, unit, forward)[: max(0, room)]
    return sum(profile.chunks[c].bytes for c in queue if ends[c] == upcoming)


def backward_update_done(
    profile: ModelProfile,
    tables: ChunkTables,
    rate: float,
    p: int,
    left_after: np.ndarray,
    split: BackwardSplit | None = None,
) -> float:
    """Under ``update_in_backward``: when (seconds after ``step()``, 0 if before it, as without
    offloaded trainable chunks) every offloaded chunk the CPU updates in plan ``n_persist = p``
    is updated.

    Updates run in arrival order, chunk n-1 (the first whose gradients arrive) to the lowest the
    CPU updates, q (the last, and the first of its chunks the next forward needs), so the
    forward waits for all of them there. q is p, or the lowest chunk above the ones the GPU
    updates in the backward (``update_split.backward_split``, row 0 of ``split``). With
    ``left_after[u]`` the backward's wall time left once unit u's backward is done (the sum of
    the windows of the units before u: recompute and exposed copies included, plus the
    persistent chunks' steps, which come after every offloaded chunk's gradients) and H(c) =
    ``left_after[first_unit(c)]`` the backward left after chunk c's gradients arrive:
        done = max(cpu_numel / rate - H(n-1), numel[q] / rate - H(q), 0)
    (H counting the units' backward compute alone predicted the step 25-44% slow on 3.6B,
    whose 28 checkpointed blocks recompute 55 ms.)
    """
    first, _ = chunk_spans(profile)
    n = profile.n_chunks
    if split is not None:
        cpu_numel, lowest_numel = float(split.cpu_numel[0]), float(split.lowest_numel[0])
        lowest_first = int(split.lowest_first[0])
    elif p < n:
        cpu_numel, lowest_numel = float(tables.offload_numel[p]), profile.chunks[p].trainable_numel
        lowest_first = int(first[p])
    else:
        return 0.0  # nothing offloaded
    if cpu_numel <= 0:
        return 0.0
    return max(
        cpu_numel / rate - float(left_after[first[n - 1]]),
        lowest_numel / rate - float(left_after[lowest_first]),
        0.0,
    )


def accumulation_terms(
    profile: ModelProfile,
    tables: ChunkTables,
    rate: float,
    p: int,
    left_after: np.ndarray,
    gpu_micro_s: float,
    gpu_sum_micro_s: float = 0.0,
) -> tuple[float, float, float]:
    """Gradient accumulation over ``M = profile.micro_batches`` micro-batches per step:
    ``(later_micro_s, lag_s, worker_s)``.

    A step runs M forwards and backwards, then ``optimizer.step()``. Every backward copies the
    offloaded chunks' gradients to the host, where the CPU worker adds each micro-batch's onto
    the sum of the earlier ones at ``rate`` (``HardwareProfile.cpu_accumulate_params_per_s``),
    in arrival order, beside the GPU (the next forward gathers weights, which the adds do not
    touch). With A = offload_numel / rate (one micro-batch's adds) and ``gpu_micro_s`` a later
    micro-batch's GPU time (its forward from the first gathers, no CPU update to wait for, and
    its backward without the cross-rank all-reduce that ``no_sync`` skips):
        later_micro_s = max(gpu_micro_s, A)        (the worker must keep pace, or the next
                                                    backward's copies wait for its staging;
                                                    the second one's worker also copies the
                                                    first's gradients out: ``later_on_cpu``)
        lag_s = backward_update_done at ``rate``   (the adds still running after the last
                                                    backward, which the update at step() queues
                                                    behind, so its ready times shift by lag_s)
        step = first micro-batch (``step_windows``, its update waits shifted by lag_s)
               + (M - 1) * later_micro_s
    ``worker_s`` is A. All zero with one micro-batch; A and lag_s zero at an unmeasured
    (infinite) rate. The first micro-batch's gradients are copied, not added: it runs as
    without accumulation. (The update in the backward never runs with accumulation: no lag.)

    Accumulating on the GPU (``accumulates_on_gpu``), the CPU adds nothing: each later backward
    window copies the running sum of the gradients it sends out back in first (the same bytes
    as those gradients, host to device, on the copy engine the gathers use), and the last
    chunk's sum comes in and goes out after the backward's end. ``gpu_sum_micro_s`` is that
    micro-batch's GPU time, and
        later_micro_s = gpu_sum_micro_s,  lag_s = 0,  worker_s = 0."""
    if profile.micro_batches <= 1:
        return 0.0, 0.0, 0.0
    if accumulates_on_gpu(profile):
        return gpu_sum_micro_s, 0.0, 0.0
    worker_s = float(tables.offload_numel[p]) / rate if math.isfinite(rate) else 0.0
    lag = 0.0
    if worker_s and not profile.update_in_backward:
        lag = backward_update_done(profile, tables, rate, p, left_after)
    return later_on_cpu(gpu_micro_s, worker_s, profile.micro_batches), lag, worker_s


def later_on_cpu(gpu_s, adds_s, micro: int):
    """The mean wall time of the M - 1 later micro-batches accumulating on the CPU (scalars or
    arrays): each is max(G, A), except the second, whose worker first copies the first
    micro-batch's gradients out of the staging they were left in (``release_staging``; costed
    at the add rate, C = A): max(G, 2A)."""
    return ((micro - 2) * np.maximum(gpu_s, adds_s) + np.maximum(gpu_s, 2 * adds_s)) / (micro - 1)


@dataclass(frozen=True)
class StepWindows:
    """The predicted step, window by window (``predict_step_time``'s formulas).

    ``fwd[u]`` is w_f[u] (unit u's forward with the prefetch of u+1 beside it, and u+1's
    exposed gathers); ``bwd[u]`` is w_b[u] (unit u's backward with its recompute, the prefetch
    of u-1 and the gradients of u+1 going out). ``t_fwd`` adds the start (the GPU optimizer or
    the first gathers) and the waits for the CPU update to them; ``t_bwd`` the last gradients'
    copy out.
    """

    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    t_fwd: float
    t_bwd: float
    gpu_optim_s: float
    recompute_s: float
    stalls: dict[str, float]
    cpu_update_s: float = 0.0
    """Seconds of the CPU optimizer's work (its chunks' elements / its rate)."""
    gpu_update_s: float = 0.0
    """Seconds of the GPU update path (``plan/update_split.py``), beside the CPU's."""
    gpu_update_chunks: int = 0
    gpu_backward_chunks: int = 0
    """Offloaded chunks the GPU updates in the backward (``update_split.backward_split``)."""
    backward_update_bytes: tuple[float, float] = (0.0, 0.0)
    """Bytes that GPU path adds in and out (state in; weights and state out, less gradients)."""
    later_micro_s: float = 0.0
    """Gradient accumulation: the wall time of each micro-batch after the first of a step
    (``accumulation_terms``); 0 with one micro-batch."""
    accumulate_lag_s: float = 0.0
    """Gradient accumulation: how long after the last backward the CPU worker is still adding
    gradients, which the update at ``step()`` waits for (``accumulation_terms``)."""


def persistent_allreduce_exposed(
    done_bytes: np.ndarray, windows: np.ndarray, allreduce_bps: float
) -> np.ndarray:
    """Seconds the persistent chunks' gradient all-reduces (data parallelism) run past the last
    backward window. Each starts once its chunk's backward is complete (after its lowest unit's
    window), in one queue at ``allreduce_bps``. With ``end[u]`` the end of unit u's backward
    window (units run last to first: end[u] = sum_{v >= u} w[v]) and ``done[u]`` the bytes
    completed there, the queue's max-plus closed form is
        q = max_u (end[u] + sum_{v <= u} done[v] / B_allreduce);   exposed = max(0, q - end[0])
    ``windows``: (..., U) without the recompute (a checkpointed unit's recompute only widens
    the overlap: leaving it out errs long, and keeps the term out of the n_checkpoint prefix
    sums of ``plan/grid.py``); ``done_bytes``: (U,) or broadcastable to ``windows``. 0 on one
    process (``allreduce_bps`` inf)."""
    windows = np.asarray(windows, dtype=np.float64)
    if not math.isfinite(allreduce_bps):
        return np.zeros(windows.shape[:-1])
    ends = np.cumsum(windows[..., ::-1], axis=-1)[..., ::-1]
    queued = np.cumsum(np.asarray(done_bytes, dtype=np.float64), axis=-1) / allreduce_bps
    return np.maximum((ends + queued).max(axis=-1) - ends[..., 0], 0.0)


def step_windows(
    profile: ModelProfile, hw: HardwareProfile, knobs: Knobs, tables: ChunkTables | None = None
) -> StepWindows:
    """The windows of ``predict_step_time`` (to compare with a measured step, unit by unit)."""
    tables = tables or chunk_tables(profile)
    check_knobs(profile, knobs, tables)
    p, n_buffer = knobs.n_persist, knobs.n_buffer
    policies = unit_policies(profile.n_blocks, knobs.n_swap, knobs.n_checkpoint)
    units = profile.units
    n_units = len(units)
    resident = tables.resident[p]
    stalls = {"pcie_h2d": 0.0, "pcie_d2h": 0.0, "cpu_optimizer": 0.0}

    def window(compute: float, h2d: float, d2h: float, exposed: float) -> float:
        xfer = transfer_s(h2d, d2h, hw)
        if xfer > compute:
            stalls["pcie_h2d" if h2d / hw.h2d_bps >= d2h / hw.d2h_bps else "pcie_d2h"] += (
                xfer - compute
            )
        stalls["pcie_h2d"] += exposed
        return max(compute, xfer) + exposed

    fwd_windows = []
    for u in range(n_units):
        gather_bytes = float(tables.fwd_gather_bytes[p, u + 1]) if u + 1 < n_units else 0.0
        prefetched = prefetched_bytes(profile, p, u, n_buffer - int(resident[u]), forward=True)
        swap_out = float(units[u].act_bytes_keep) if policies[u] == "swap" else 0.0
        exposed = (gather_bytes - prefetched) / hw.h2d_bps
        fwd_windows.append(window(units[u].fwd_s, float(prefetched), swap_out, exposed))
    gpu_optim_s = float(tables.persist_numel[p]) / hw.gpu_optim_params_per_s
    # The user's optimizer steps the persistent chunks at step(), before the next forward;
    # under the update in the backward on one process it steps them in the backward (counted
    # in T_bwd).
    at_step_s = 0.0 if profile.persistent_in_backward else gpu_optim_s
    first_gather_s = float(tables.fwd_gather_bytes[p, 0]) / hw.h2d_bps
    stalls["pcie_h2d"] += max(0.0, first_gather_s - at_step_s)
    unconstrained = max(at_step_s, first_gather_s) + sum(fwd_windows)
    suffix = np.cumsum(fwd_windows[::-1])[::-1]

    # Under the update in the backward the GPU updates the lowest offloaded chunks there: their
    # state comes in, their weights and state go out in place of their gradients.
    split = backward_split(profile, hw, np.array([p])) if profile.update_in_backward else None
    out_bytes = tables.grad_d2h_bytes[p] + (split.out_delta[0] if split else 0)
    state_in = split.state_in[0] if split else np.zeros(n_units)
    bwd_windows = []
    plain_windows = []  # without the recompute (``persistent_allreduce_exposed``)
    summing_windows = []  # a later micro-batch's, accumulating on the GPU
    recompute_s = 0.0
    for u in range(n_units):
        gather_bytes = float(tables.bwd_gather_bytes[p, u - 1]) if u > 0 else 0.0
        prefetched = prefetched_bytes(profile, p, u, n_buffer - int(resident[u]), forward=False)
        swap_in = float(units[u - 1].act_bytes_keep) if u > 0 and policies[u - 1] == "swap" else 0.0
        grads_out = float(out_bytes[u + 1]) if u + 1 < n_units else 0.0
        recompute = units[u].fwd_s if policies[u] == "checkpoint" else 0.0
        recompute_s += recompute
        exposed = (gather_bytes - prefetched) / hw.h2d_bps
        compute = units[u].bwd_s + recompute
        h2d = prefetched + swap_in + float(state_in[u])
        bwd_windows.append(window(compute, h2d, grads_out, exposed))
        plain_windows.append(max(units[u].bwd_s, transfer_s(h2d, grads_out, hw)) + exposed)
        summing_windows.append(max(compute, transfer_s(h2d + grads_out, grads_out, hw)) + exposed)
    tail_s = float(out_bytes[0]) / hw.d2h_bps
    stalls["pcie_d2h"] += tail_s
    allreduce_s = float(
        persistent_allreduce_exposed(
            tables.persist_grad_done[p], np.array(plain_windows), hw.allreduce_bps
        )
    )
    stalls["collective"] = max(0.0, allreduce_s - tail_s)
    t_bwd = sum(bwd_windows) + max(tail_s, allreduce_s) + (gpu_optim_s - at_step_s)
    # A later micro-batch of gradient accumulation: gathers from the start, no update to wait
    # for, no all-reduce (``no_sync``), and its persistent gradients kept, not stepped.
    later_gpu_s = first_gather_s + sum(fwd_windows) + sum(bwd_windows) + tail_s
    later_gpu_s += gpu_optim_s - at_step_s
    # The same micro-batch summing on the GPU: the last chunk's sum in, then out, at the end.
    summing_gpu_s = first_gather_s + sum(fwd_windows) + sum(summing_windows) + tail_s
    summing_gpu_s += float(out_bytes[0]) / hw.h2d_bps + gpu_optim_s - at_step_s
    later_micro_s, lag, worker_s = accumulation_terms(
        profile,
        tables,
        hw.cpu_accumulate_params_per_s,
        p,
        np.concatenate([[0.0], np.cumsum(bwd_windows)]),
        later_gpu_s,
        summing_gpu_s,
    )

    t_fwd = unconstrained
    early = None
    if profile.update_in_backward:
        # Persistent chunks stepped in the backward are stepped after every offloaded chunk's
        # gradients arrived (they come first in the forward, last in the backward): the CPU
        # works through that too (at step(), the forward's start covers it).
        in_bwd_s = gpu_optim_s - at_step_s
        left_after = np.concatenate([[0.0], np.cumsum(bwd_windows)]) + in_bwd_s
        rate = hw.cpu_optim_params_per_s
        early = backward_update_done(profile, tables, rate, p, left_after, split)
    split_ready, gpu_chunks, _, cpu_s, gpu_s, _ = update_split_row(profile, hw, p)
    for u in range(n_units):
        waits = split.cpu_units[0, u] if split else tables.cpu_ready_numel[p, u] >= 0
        if waits:
            ready = split_ready[u] + lag if early is None else early
            ready += float(tables.fwd_gather_bytes[p, u]) / hw.h2d_bps
            t_fwd = max(t_fwd, ready + float(suffix[u]))
    stalls["cpu_optimizer"] = t_fwd - unconstrained
    if profile.micro_batches > 1:
        # Every micro-batch runs the same windows: their stalls recur; the worker's adds stall
        # a later micro-batch where they outlast its GPU time.
        later = profile.micro_batches - 1
        for name in ("pcie_h2d", "pcie_d2h"):
            stalls[name] *= profile.micro_batches
        if accumulates_on_gpu(profile):
            # The sums' copies in: PCIe time the later backward windows add.
            stalls["pcie_h2d"] += later * (later_micro_s - later_gpu_s)
            stalls["cpu_accumulate"] = 0.0
        else:
            stalls["cpu_accumulate"] = later * (later_micro_s - later_gpu_s)
    return StepWindows(
        tuple(float(w) for w in fwd_windows),
        tuple(float(w) for w in bwd_windows),
        float(t_fwd),
        float(t_bwd),
        gpu_optim_s,
        recompute_s,
        stalls,
        cpu_s if split is None else float(split.cpu_numel[0]) / hw.cpu_optim_params_per_s,
        gpu_s,
        gpu_chunks,
        int(split.gpu_chunks[0]) if split else 0,
        (float(state_in.sum()), float(split.out_delta[0].sum())) if split else (0.0, 0.0),
        later_micro_s,
        lag,
    )


@dataclass(frozen=True)
class StepPrediction:
    """The predicted step of one configuration."""

    step_s: float
    breakdown: dict[str, float]
    """The terms behind ``step_s`` (seconds, bytes, counts), for diagnostics."""
    bottleneck: str
    update: UpdatePlacement
    """Where the configuration runs the optimizer's update and the accumulation's sums."""


def predict_step_time(
    profile: ModelProfile, hw: HardwareProfile, knobs: Knobs, tables: ChunkTables | None = None
) -> tuple[float, dict[str, float], str]:
    """Predicted seconds per step, its breakdown, and the bottleneck's name (``predict_step``)."""
    prediction = predict_step(profile, hw, knobs, tables)
    return prediction.step_s, prediction.breakdown, prediction.bottleneck


def predict_step(
    profile: ModelProfile, hw: HardwareProfile, knobs: Knobs, tables: ChunkTables | None = None
) -> StepPrediction:
    """Predicted seconds per step, its breakdown, the bottleneck's name, and where the update
    runs.

    Time 0 is ``optimizer.step()`` of the previous step. Per forward window u (unit u computes,
    the gathers of u+1 prefetch into the buffers u leaves free, u's swapped activations go out):
        pre_f[u]   = prefetched_bytes(u, room = n_buffer - resident[u])      (bytes of u+1's)
        xfer_f[u]  = transfer_s(pre_f[u], swap_out[u])
        w_f[u]     = max(fwd_s[u], xfer_f[u]) + (gather_bytes[u+1] - pre_f[u]) / B_h2d      (s)
    The CPU optimizer updates offloaded chunks in order from t=0; gathers of u wait for them:
        ready[u]   = update_ready_s[u] + gather_bytes[u] / B_h2d
    (``plan/update_split.py``: cpu_ready_numel[u] / cpu_rate when the CPU updates every chunk)
    (under ``update_in_backward``: ``backward_update_done``, from the backward windows below,
    + gather_bytes[u] / B_h2d)
        T_fwd      = max(max(gpu_optim, gather_bytes[0] / B_h2d) + sum_u w_f[u],
                         max_u (ready[u] + sum_{v >= u} w_f[v]))                             (s)
    with gpu_optim = persist_numel / gpu_rate (the user's optimizer on persistent chunks; under
    ``update_in_backward`` it steps them in the backward: 0 here, added to T_bwd).
    Per backward window u (reverse order; prefetch gathers and swap-in of u-1, grads of u+1 out):
        pre_b[u]   = prefetched_bytes(u, room = n_buffer - resident[u], backward)  (of u-1's)
        xfer_b[u]  = transfer_s(pre_b[u] + swap_in[u-1], grad_d2h[u+1])
        w_b[u]     = max(bwd_s[u] + recompute[u], xfer_b[u]) + (bwd_gather[u-1] - pre_b[u])/B_h2d
        T_bwd      = sum_u w_b[u] + max(grad_d2h[0] / B_d2h, allreduce_exposed)              (s)
    (``allreduce_exposed``: data parallelism's persistent gradient all-reduces past the last
    window, ``persistent_allreduce_exposed``; 0 on one process)
    (the post unit L+1 gathers nothing: its chunks stay from its forward; ``chunk_tables``)
    step = T_fwd + T_bwd + other_s, and with gradient accumulation over M micro-batches
    + (M - 1) * later_micro_s, the CPU update's ready times shifted by the adds' lag
    (``accumulation_terms``).
    """
    tables = tables or chunk_tables(profile)
    windows = step_windows(profile, hw, knobs, tables)
    p = knobs.n_persist
    policies = unit_policies(profile.n_blocks, knobs.n_swap, knobs.n_checkpoint)
    units = profile.units
    stalls, recompute_s = windows.stalls, windows.recompute_s
    t_fwd, t_bwd, gpu_optim_s = windows.t_fwd, windows.t_bwd, windows.gpu_optim_s
    micro = profile.micro_batches
    later_s = (micro - 1) * windows.later_micro_s
    step_s = t_fwd + t_bwd + later_s + profile.other_s

    swap_bytes = micro * sum(u.act_bytes_keep for u, pol in zip(units, policies) if pol == "swap")
    gathers = tables.fwd_gather_bytes[p].sum() + tables.bwd_gather_bytes[p].sum()
    breakdown = {
        "step_s": step_s,
        "fwd_s": t_fwd,
        "bwd_s": t_bwd,
        "fwd_compute_s": sum(u.fwd_s for u in units),
        "bwd_compute_s": sum(u.bwd_s for u in units),
        "recompute_s": recompute_s,
        "gpu_optim_s": gpu_optim_s,
        "cpu_optim_s": windows.cpu_update_s,
        "gpu_update_s": windows.gpu_update_s,
        "gpu_update_chunks": windows.gpu_update_chunks,
        "gpu_backward_chunks": windows.gpu_backward_chunks,
        "other_s": profile.other_s,
        "h2d_stall_s": stalls["pcie_h2d"],
        "d2h_stall_s": stalls["pcie_d2h"],
        "cpu_optim_stall_s": stalls["cpu_optimizer"],
        "collective_stall_s": stalls["collective"],
        "h2d_bytes": float(micro * gathers)
        + swap_bytes
        + windows.backward_update_bytes[0]
        + (micro - 1) * float(tables.grad_d2h_bytes[p].sum()) * accumulates_on_gpu(profile),
        "d2h_bytes": float(micro * tables.grad_d2h_bytes[p].sum())
        + swap_bytes
        + windows.backward_update_bytes[1],
        "swap_bytes": float(swap_bytes),
        "tokens_per_s": micro * profile.batch_tokens / step_s if step_s > 0 else math.inf,
        "update_in_backward": float(profile.update_in_backward),
        "persistent_at_step": float(profile.persistent_at_step),
        "micro_batches": float(micro),
        "later_micro_s": windows.later_micro_s,
        "accumulate_lag_s": windows.accumulate_lag_s,
        "cpu_accumulate_stall_s": stalls.get("cpu_accumulate", 0.0),
        "accumulate_on_gpu": float(accumulates_on_gpu(profile)),
    }
    breakdown = {key: float(value) for key, value in breakdown.items()}
    update = UpdatePlacement(
        gpu_update_chunks=int(windows.gpu_update_chunks),
        gpu_backward_chunks=int(windows.gpu_backward_chunks),
        accumulate_on_gpu=accumulates_on_gpu(profile),
        update_in_backward=bool(profile.update_in_backward),
        persistent_at_step=bool(profile.persistent_at_step),
        micro_batches=int(micro),
    )
    return StepPrediction(
        float(step_s), breakdown, _bottleneck(step_s, recompute_s, stalls), update
    )


def _bottleneck(step_s: float, recompute_s: float, stalls: dict[str, float]) -> str:
    """The largest of the stalls and the recompute, or "compute" if none reaches 5% of the step."""
    costs = {**stalls, "recompute": recompute_s}
    name = max(costs, key=costs.__getitem__)
    return name if costs[name] >= BOTTLENECK_MIN_SHARE * step_s else "compute"
