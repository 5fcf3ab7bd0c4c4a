"""The vectorised evaluation of every configuration of one chunk layout (``plan.search`` runs it
per layout and keeps the best pick; its module docstring gives the shape of the work).

``search_layout`` builds the chunk terms from ``residency.chunk_tables`` and ``queued_bytes`` as
(n_persist, n_buffer, unit) arrays once, then loops over ``n_swap`` and evaluates every
``n_checkpoint`` at once: the step time as a prefix sum of the windows' recompute, the peak with
``_split_max``. It computes the cost model's formulas, element for element;
``tests/plan/test_search.py`` checks every row against the scalar model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from autooffload.plan.configuration import accumulates_on_gpu
from autooffload.plan.cost_memory import (
    accumulate_scratch_bytes,
    optimizer_step_bytes,
    persist_grads_in_backward,
)
from autooffload.plan.cost_time import later_on_cpu, persistent_allreduce_exposed
from autooffload.plan.profile_types import HardwareProfile, ModelProfile
from autooffload.plan.residency import ChunkTables, chunk_spans, chunk_tables, queued_bytes
from autooffload.plan.types import Knobs
from autooffload.plan.update_split import backward_split, update_split

_NONE = np.iinfo(np.int64).min // 4  # "no unit": below any peak, far from overflow


@dataclass(frozen=True)
class Pick:
    """One configuration and its predictions; ordered by (step_s, peak) for the choice."""

    step_s: float
    peak: int
    knobs: Knobs
    profile: ModelProfile = field(compare=False, repr=False)


def pick_order(pick: Pick, by_peak: bool = False) -> tuple[float, float]:
    """The sort key of a pick: fastest first (smallest peak first with ``by_peak``)."""
    return (pick.peak, pick.step_s) if by_peak else (pick.step_s, pick.peak)


def search_layout(
    profile: ModelProfile,
    hw: HardwareProfile,
    budget: int | None,
    fixed: dict[str, int],
    rows: list[tuple[np.ndarray, ...]] | None,
    by_peak: bool,
    min_persist: int = 0,
    host_room: int | None = None,
) -> Pick | None:
    """Evaluate every configuration of one layout (see the module docstring for the shape);
    with ``host_room``, only those whose activations in host memory fit it
    (``configuration.host_activation_bytes``)."""
    tables = chunk_tables(profile)
    n_blocks, n_units = profile.n_blocks, profile.n_units
    if fixed.get("n_persist", 0) > profile.n_chunks:
        return None
    persist = knob_values(fixed, "n_persist", profile.n_chunks)
    persist = persist[persist >= min_persist]
    static = (
        tables.persist_bytes
        + profile.optim_bytes_per_param * tables.persist_numel
        + profile.static_bytes
        + accumulate_scratch_bytes(profile)
        + (tables.persist_grad_total if profile.grad_accumulation else 0)
    )
    frag = profile.fragmentation_factor
    if budget is not None:
        # Prune n_persist whose static bytes and live chunks alone already exceed the budget.
        least = static + tables.resident_bytes.max(axis=1)
        fits = hw.cuda_context_bytes + np.ceil(frag * least[persist].astype(float)) <= budget
        persist = persist[fits]
    buffers, valid = _buffer_grid(tables, persist, fixed.get("n_buffer"))
    if persist.size == 0 or not valid.any():
        return None
    units = profile.units
    fwd_s = np.array([u.fwd_s for u in units])
    bwd_s = np.array([u.bwd_s for u in units])
    keep = np.array([u.act_bytes_keep for u in units], dtype=np.int64)
    ckpt = np.array([u.act_bytes_checkpoint for u in units], dtype=np.int64)
    fwd_transient = np.array([u.fwd_transient_bytes for u in units], dtype=np.int64)
    bwd_transient = np.array([u.bwd_transient_bytes for u in units], dtype=np.int64)
    h2d, d2h, duplex = hw.h2d_bps, hw.d2h_bps, hw.duplex_bps

    # Chunk-traffic terms, shape (P, D, U): the same for every n_swap / n_checkpoint.
    room = np.maximum(buffers[:, :, None] - tables.resident[persist][:, None, :], 0)
    fwd_next_count = _shift(tables.fwd_gather_count[persist], -1)[:, None, :]
    fwd_next_bytes = _shift(tables.fwd_gather_bytes[persist], -1)[:, None, :]
    bwd_prev_count = _shift(tables.bwd_gather_count[persist], 1)[:, None, :]
    bwd_prev_bytes = _shift(tables.bwd_gather_bytes[persist], 1)[:, None, :]
    queued = queued_bytes(
        profile,
        persist,
        [room, np.minimum(room, fwd_next_count)],
        [room, np.minimum(room, bwd_prev_count)],
    )
    (fwd_window, fwd_prefetch), (bwd_window, bwd_prefetch) = queued
    fwd_exposed = (fwd_next_bytes - fwd_prefetch).astype(float) / h2d
    bwd_exposed = (bwd_prev_bytes - bwd_prefetch).astype(float) / h2d
    fwd_prefetch, bwd_prefetch = fwd_prefetch.astype(float), bwd_prefetch.astype(float)
    in_backward = profile.update_in_backward
    # Under the update in the backward, the chunks the GPU updates there (``backward_split``):
    # their state in, their weights and state out in place of their gradients.
    bsplit = backward_split(profile, hw, persist) if in_backward else None
    out_bytes = tables.grad_d2h_bytes[persist] + (bsplit.out_delta if bsplit else 0)
    state_in = (bsplit.state_in if bsplit else np.zeros(out_bytes.shape))[:, None, :]
    grads_out = _shift(out_bytes, -1).astype(float)[:, None, :]
    gpu_optim = tables.persist_numel[persist] / hw.gpu_optim_params_per_s
    first_gather = tables.fwd_gather_bytes[persist, 0] / h2d
    ready_numel = tables.cpu_ready_numel[persist]
    split = update_split(profile, hw, persist)
    # Under update_in_backward one time ``done`` (per K, P, D: it depends on the backward's
    # windows) holds for every chunk, so the forward's wait is done + max over the ready units
    # of (gather + the forward after it); otherwise each unit has its own ready time.
    cpu_done = np.zeros(ready_numel.shape) if in_backward else split.ready_s
    waiting = bsplit.cpu_units if bsplit else ready_numel >= 0
    ready = np.where(waiting, cpu_done + tables.fwd_gather_bytes[persist] / h2d, -np.inf)[
        :, None, :
    ]
    first_unit, _ = chunk_spans(profile)
    n_chunks = profile.n_chunks
    # The first unit of the last chunk, whose gradients arrive first in the backward.
    last_first = np.full(persist.size, int(first_unit[n_chunks - 1]))
    if in_backward:
        rate = hw.cpu_optim_params_per_s
        assert bsplit is not None
        # Per n_persist p (p = n_chunks included: nothing offloaded, no update to wait for).
        offload_s = bsplit.cpu_numel / rate
        own_s = bsplit.lowest_numel / rate
        own_first = bsplit.lowest_first
    micro = profile.micro_batches
    accumulate_rate = hw.cpu_accumulate_params_per_s
    summing = accumulates_on_gpu(profile)
    accumulating = micro > 1 and not summing and bool(np.isfinite(accumulate_rate))
    if accumulating:
        # ``cost_time.accumulation_terms``: one micro-batch's adds, and the chunks whose adds the
        # update at step() waits for (all offloaded ones; the lowest, first needed, last).
        adds_s = tables.offload_numel[persist] / accumulate_rate
        after_lowest = tables.offload_numel[np.minimum(persist + 1, n_chunks)]
        lowest_s = (tables.offload_numel[persist] - after_lowest) / accumulate_rate
        lowest_first = first_unit[np.minimum(persist, n_chunks - 1)]
    tail = out_bytes[:, 0] / d2h
    tail_d2h = tail
    allreduce = np.isfinite(hw.allreduce_bps) and tables.persist_grad_done[persist].any()
    done_bytes = tables.persist_grad_done[persist][:, None, :]
    # Persistent chunks stepped in the backward (``cost_time.step_windows``), else at step().
    gpu_optim_in_bwd = gpu_optim if profile.persistent_in_backward else np.zeros_like(gpu_optim)
    if profile.persistent_in_backward:
        start, tail = first_gather, tail + gpu_optim
    else:
        start = np.maximum(gpu_optim, first_gather)

    # Memory terms per (P, D, U): chunks on the device (live + prefetched) and, in the backward,
    # the live grads; the static bytes per P.
    live = tables.resident_bytes[persist][:, None, :]
    grads = tables.offload_grad_bytes[persist] + persist_grads_in_backward(profile, tables)[persist]
    # ``cost_memory.peak_breakdown``'s ``pooled``: the chunk buffers' peak over the step, plus
    # the rest's (activations, plus the gradients in the backward).
    chunk_pool = np.maximum((live + fwd_window).max(-1), (live + bwd_window).max(-1))
    # The GPU update path's scratch lives from step() into the next forward (until its last
    # chunk, which the forward needs late, is back): on top of every forward event.
    fwd_extra = np.broadcast_to(split.scratch_bytes[:, None, None], (persist.size, 1, n_units))
    bwd_extra = (grads + (bsplit.scratch if bsplit else 0))[:, None, :]
    static_p = static[persist][None, :, None]
    step_bytes = (optimizer_step_bytes(profile, tables, persist) + split.scratch_bytes)[
        None, :, None
    ]

    best = None
    unit_index = np.arange(n_units)
    # Host bytes of the first n blocks swapped, and of the first n blocks' inputs on the host.
    swap_host = np.concatenate([[0], np.cumsum(keep[1 : n_blocks + 1])])
    inputs = np.zeros(n_blocks, dtype=np.int64)
    inputs[: len(profile.host_input_bytes)] = profile.host_input_bytes
    inputs_host = np.concatenate([[0], np.cumsum(inputs)])
    for n_swap in knob_values(fixed, "n_swap", n_blocks):
        checkpoints = knob_values(fixed, "n_checkpoint", n_blocks - n_swap)
        if host_room is not None:
            held = swap_host[n_swap] + inputs_host[n_swap + checkpoints] - inputs_host[n_swap]
            checkpoints = checkpoints[held <= host_room]
        if checkpoints.size == 0:
            continue
        swapped = (unit_index >= 1) & (unit_index <= n_swap)
        swap_out = np.where(swapped, keep, 0).astype(float)
        swap_in = _shift(swap_out, 1)

        # Step time, shape (K, P, D): forward windows, CPU-optimizer max-plus, backward + prefix.
        fwd_xfer = _transfer(fwd_prefetch, swap_out, h2d, d2h, duplex)
        fwd_windows = np.maximum(fwd_s, fwd_xfer) + fwd_exposed
        after = np.cumsum(fwd_windows[..., ::-1], axis=-1)[..., ::-1]
        waits = (ready + after).max(axis=-1)
        t_fwd = np.maximum(start[:, None] + after[..., 0], waits)
        bwd_xfer = _transfer(bwd_prefetch + swap_in + state_in, grads_out, h2d, d2h, duplex)
        base = np.maximum(bwd_s, bwd_xfer)
        extra = np.maximum(bwd_s + fwd_s, bwd_xfer) - base
        t_bwd = tail[:, None] + (base + bwd_exposed).sum(axis=-1)
        # A later micro-batch of gradient accumulation (``cost_time.accumulation_terms``): the
        # forward from its first gathers, the backward without the all-reduce (``no_sync``).
        later_gpu = first_gather[:, None] + after[..., 0] + t_bwd
        if summing:
            # Accumulating on the GPU: each window also copies the running sum of the
            # gradients it sends out back in, the last ones' after the end.
            sum_xfer = _transfer(
                bwd_prefetch + swap_in + state_in + grads_out, grads_out, h2d, d2h, duplex
            )
            sum_base = np.maximum(bwd_s, sum_xfer)
            sum_extra = np.maximum(bwd_s + fwd_s, sum_xfer) - sum_base
            later_gpu = (
                first_gather[:, None]
                + after[..., 0]
                + tail[:, None]
                + out_bytes[:, None, 0] / h2d
                + (sum_base + bwd_exposed).sum(axis=-1)
            )
            sum_extra_before = np.concatenate(
                [np.zeros((*sum_extra.shape[:2], 1)), sum_extra.cumsum(-1)], -1
            )
        if allreduce:
            # Data parallelism: the persistent all-reduces past the last window, beyond the
            # D2H tail (``cost_time.persistent_allreduce_exposed``).
            exposed = persistent_allreduce_exposed(done_bytes, base + bwd_exposed, hw.allreduce_bps)
            t_bwd = t_bwd + np.maximum(exposed - tail_d2h[:, None], 0.0)
        extra_before = np.concatenate([np.zeros((*extra.shape[:2], 1)), extra.cumsum(-1)], -1)
        ckpt_end = n_swap + 1 + checkpoints
        if in_backward or accumulating:
            # The backward's wall time before each unit (``_backward_left``): the update in
            # the backward and the adds of accumulation both finish against it.
            windows_before = np.concatenate(
                [np.zeros((*base.shape[:2], 1)), (base + bwd_exposed).cumsum(-1)], -1
            )
        recompute = extra_before[..., n_swap + 1 + checkpoints] - extra_before[..., [n_swap + 1]]
        if in_backward:
            # ``cost_time.backward_update_done`` for every (K, P, D): H(c) is the backward's windows
            # before chunk c's first unit, with the recompute of the checkpointed ones.
            # + the persistent chunks' steps in the backward, after every offloaded chunk's
            # gradients arrived.
            done = _backward_done(
                windows_before,
                extra_before,
                (n_swap + 1, ckpt_end),
                ((last_first, offload_s), (own_first, own_s)),
                gpu_optim_in_bwd[None, :, None],
            )
            t_fwd = np.maximum(t_fwd[None], done + waits[None])
        else:
            t_fwd = t_fwd[None]
        recompute = np.moveaxis(recompute, -1, 0)
        later_micro = 0.0
        if summing:
            sum_recompute = (
                sum_extra_before[..., n_swap + 1 + checkpoints]
                - sum_extra_before[..., [n_swap + 1]]
            )
            later_micro = later_gpu[None] + np.moveaxis(sum_recompute, -1, 0)
        elif micro > 1:
            later_micro = later_gpu[None] + recompute
            if accumulating:
                later_micro = later_on_cpu(later_micro, adds_s[None, :, None], micro)
            if accumulating and not in_backward:
                lag = _backward_done(
                    windows_before,
                    extra_before,
                    (n_swap + 1, ckpt_end),
                    ((last_first, adds_s), (lowest_first, lowest_s)),
                )
                t_fwd = np.maximum(t_fwd, waits[None] + lag)
        step = t_fwd + t_bwd[None] + recompute + profile.other_s + (micro - 1) * later_micro

        # Peak memory, shape (K, P, D), for every n_checkpoint at once without a K x P x D x U
        # array: with k checkpoints, units u <= n_swap + k + 1 see every non-swapped block before
        # them checkpointed, and later units see the keep-all events minus the constant saving
        # C_k of the k checkpoints (``cost_memory.activation_events``): a prefix max and a
        # suffix max.
        kept = np.where(swapped, 0, keep)
        blocks = (unit_index > n_swap) & (unit_index <= n_blocks)
        all_ckpt = np.where(blocks, ckpt, kept)
        current = _shift(np.where(swapped, keep, 0), 1) + keep
        events_ckpt = np.cumsum(all_ckpt) - all_ckpt + current
        events_keep = np.cumsum(kept) - kept + current
        bound = n_swap + 1 + checkpoints
        saving = np.cumsum(keep - ckpt)
        saving = saving[bound - 1] - saving[n_swap]
        fwd_peak = _split_max(
            events_ckpt + fwd_transient, events_keep + fwd_transient, fwd_extra, bound, saving
        )
        bwd_peak = _split_max(
            events_ckpt + bwd_transient, events_keep + bwd_transient, bwd_extra, bound, saving
        )
        compute = np.maximum(np.maximum(fwd_peak, bwd_peak), step_bytes)
        pooled = static_p + compute + chunk_pool[None]
        peak = hw.cuda_context_bytes + np.ceil(frag * pooled.astype(float)).astype(np.int64)

        ok = np.broadcast_to(valid[None], peak.shape)
        if budget is not None:
            ok = ok & (peak <= budget)
        best = _better_pick(
            best, peak, step, ok, profile, persist, buffers, n_swap, checkpoints, by_peak
        )
        if rows is not None and ok.any():
            k_idx, p_idx, d_idx = np.nonzero(ok)
            count = k_idx.size
            rows.append(
                (
                    np.full(count, profile.chunk_size, dtype=np.int64),
                    persist[p_idx],
                    buffers[p_idx, d_idx],
                    np.full(count, n_swap, dtype=np.int64),
                    checkpoints[k_idx],
                    peak[ok],
                    step[ok],
                    micro * profile.batch_tokens / step[ok],
                )
            )
    return best


def _backward_done(
    windows_before: np.ndarray,
    extra_before: np.ndarray,
    checkpointed: tuple[int, np.ndarray],
    work: tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]],
    after_s: np.ndarray | float = 0.0,
) -> np.ndarray:
    """``cost_time.backward_update_done`` for every (K, P, D): when CPU work queued in the
    backward's arrival order is done, after the backward ends. ``work`` is (first unit, seconds)
    of all of it and of its last piece (per P, the lowest chunk's); with H(u) =
    ``_backward_left`` + ``after_s`` (what runs after the backward's windows),
        done = max(all_s - H(all_first), last_s - H(last_first), 0),  0 where all_s is 0.
    ``checkpointed``: (first, end per K) of the checkpointed units."""
    ckpt_start, ckpt_end = checkpointed
    done = np.zeros(())
    for unit, seconds in work:
        left = _backward_left(windows_before, extra_before, unit, ckpt_start, ckpt_end) + after_s
        done = np.maximum(done, seconds[None, :, None] - left)
    all_s = work[0][1]
    return np.where((all_s > 0)[None, :, None], done, 0.0)


def _backward_left(
    windows_before: np.ndarray,
    extra_before: np.ndarray,
    unit: np.ndarray,
    ckpt_start: int,
    ckpt_end: np.ndarray,
) -> np.ndarray:
    """The backward's wall time after ``unit[p]``'s backward, shape (K, P, D): the windows of
    the units before it (``windows_before``, cumulative, P x D x U+1) plus the recompute of
    those of them checkpointed, units ``ckpt_start`` to ``ckpt_end[k] - 1`` (``extra_before``,
    cumulative, P x D x U+1)."""
    at = np.broadcast_to(unit[:, None], windows_before.shape[:2])[..., None]
    plain = np.take_along_axis(windows_before, at, -1)[..., 0]
    low = np.minimum(at, ckpt_start)
    high = np.minimum(at[None], ckpt_end[:, None, None, None])
    upto = np.take_along_axis(
        np.broadcast_to(extra_before, high.shape[:-1] + extra_before.shape[-1:]), high, -1
    )
    recompute = upto[..., 0] - np.take_along_axis(extra_before, low, -1)[..., 0][None]
    return plain[None] + recompute


def _split_max(
    events_before: np.ndarray,
    events_after: np.ndarray,
    extra: np.ndarray,
    bound: np.ndarray,
    saving: np.ndarray,
) -> np.ndarray:
    """max(max_{u <= b_k} (events_before[u] + extra[p,d,u]),
           max_{u > b_k} (events_after[u] + extra[p,d,u]) - saving[k]), shape (K, P, D).

    ``extra``: per-unit bytes on top of the events (the backward's gradients; broadcastable to
    (P, D, U)). Running maxima are taken from the smallest ``b_k`` on only (the rest is one max)."""
    low = int(bound.min())
    head = (events_before[:low] + extra[..., :low]).max(axis=-1, initial=_NONE)
    before = np.maximum.accumulate(events_before[low:] + extra[..., low:], axis=-1)
    after = np.maximum.accumulate((events_after[low:] + extra[..., low:])[..., ::-1], axis=-1)
    after = np.concatenate([after[..., ::-1], np.full((*after.shape[:-1], 1), _NONE)], axis=-1)
    at = bound - low
    best = np.maximum(np.maximum(head[..., None], before[..., at]), after[..., at + 1] - saving)
    return np.moveaxis(best, -1, 0)


def knob_values(fixed: dict[str, int], name: str, high: int) -> np.ndarray:
    """The values a knob takes: the fixed one, or 0..high."""
    if name in fixed:
        return np.array([fixed[name]] if fixed[name] <= high else [], dtype=np.int64)
    return np.arange(high + 1, dtype=np.int64)


def _buffer_grid(
    tables: ChunkTables, persist: np.ndarray, fixed_buffers: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """n_buffer per (n_persist, offset) and whether it is evaluated: min_buffers[p] + offset, up to
    useful_buffers[p]; a fixed n_buffer is one column, valid where it is >= min_buffers[p]."""
    low = tables.min_buffers[persist]
    if fixed_buffers is not None:
        buffers = np.full((persist.size, 1), fixed_buffers, dtype=np.int64)
        return buffers, buffers[:, 0:1] >= low[:, None]
    high = tables.useful_buffers[persist]
    offsets = np.arange(int((high - low).max()) + 1 if persist.size else 1)
    buffers = low[:, None] + offsets[None, :]
    return buffers, buffers <= high[:, None]


def _shift(values: np.ndarray, by: int) -> np.ndarray:
    """Along the last axis: by=-1 puts unit u+1's value at u, by=1 unit u-1's; zeros fill in."""
    out = np.zeros_like(values)
    if by < 0:
        out[..., :by] = values[..., -by:]
    else:
        out[..., by:] = values[..., :-by]
    return out


def _transfer(h2d_bytes, d2h_bytes, h2d: float, d2h: float, duplex: float) -> np.ndarray:
    """Vectorised ``residency.transfer_s``."""
    both = np.maximum(h2d_bytes / h2d, d2h_bytes / d2h)
    return np.maximum(both, (h2d_bytes + d2h_bytes) / duplex)


def _better_pick(
    current: Pick | None,
    peak: np.ndarray,
    step: np.ndarray,
    ok: np.ndarray,
    profile: ModelProfile,
    persist: np.ndarray,
    buffers: np.ndarray,
    n_swap: int,
    checkpoints: np.ndarray,
    by_peak: bool = False,
) -> Pick | None:
    """The better of ``current`` and the best allowed entry of (peak, step) [K, P, D]."""
    if not ok.any():
        return current
    primary, secondary = (peak, step) if by_peak else (step, peak)
    primary = np.where(ok, primary, np.inf)
    candidates = np.flatnonzero(primary == primary.min())
    index = candidates[np.argmin(secondary.ravel()[candidates])]
    k_idx, p_idx, d_idx = np.unravel_index(index, peak.shape)
    knobs = Knobs(int(persist[p_idx]), int(buffers[p_idx, d_idx]), n_swap, int(checkpoints[k_idx]))
    pick = Pick(
        float(step[k_idx, p_idx, d_idx]),
        int(peak[k_idx, p_idx, d_idx]),
        knobs,
        profile,
    )
    if current is None:
        return pick
    return pick if pick_order(pick, by_peak) < pick_order(current, by_peak) else current
