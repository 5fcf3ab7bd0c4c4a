"""The memory model: the predicted peak device memory of one configuration, term by term.

Notation and units as in ``plan/configuration.py``; ``docs/planner.md`` explains every term.
"""

from __future__ import annotations

import math

import numpy as np

from autooffload.plan.configuration import accumulates_on_gpu, check_knobs, unit_policies
from autooffload.plan.profile_types import HardwareProfile, ModelProfile
from autooffload.plan.residency import ChunkTables, chunk_bytes_in_flight, chunk_tables
from autooffload.plan.types import Knobs
from autooffload.plan.update_split import backward_split, gpu_update_chunks, scratch_bytes_of

# Gradient accumulation on the GPU: the running sum comes back through a scratch of this many
# bytes (``runtime/chunks/grad_offload.py``, piece by piece), on the device for the rest of the run.
ACCUMULATE_SCRATCH_BYTES = 32 << 20


def accumulate_scratch_bytes(profile: ModelProfile) -> int:
    """Device bytes the GPU accumulation's scratch holds all step (0 without it)."""
    return ACCUMULATE_SCRATCH_BYTES if accumulates_on_gpu(profile) else 0


def activation_events(profile: ModelProfile, knobs: Knobs) -> tuple[np.ndarray, np.ndarray]:
    """Activation bytes live at each unit's forward and backward peak (grads excluded), per unit.

    saved[v]    = act_keep[v] (keep) | act_checkpoint[v] (checkpoint) | 0 (swap, once copied out)
    in_flight[u] = act_keep[u-1] if unit u-1 swaps (copy-out in forward, prefetch in backward)
    fwd[u] = sum(saved[v] for v < u) + in_flight[u] + act_keep[u] + fwd_transient[u]       (bytes)
    bwd[u] = sum(saved[v] for v < u) + in_flight[u] + act_keep[u] + bwd_transient[u]       (bytes)
    (a checkpointed unit recomputes act_keep[u]; a swapped one has it prefetched back)
    """
    policies = unit_policies(profile.n_blocks, knobs.n_swap, knobs.n_checkpoint)
    units = profile.units
    keep = np.array([u.act_bytes_keep for u in units], dtype=np.int64)
    ckpt = np.array([u.act_bytes_checkpoint for u in units], dtype=np.int64)
    saved = np.where(
        [p == "keep" for p in policies], keep, np.where([p == "swap" for p in policies], 0, ckpt)
    )
    saved_before = np.concatenate([[0], np.cumsum(saved)[:-1]])
    in_flight = np.zeros_like(keep)
    in_flight[1:] = np.where([p == "swap" for p in policies[:-1]], keep[:-1], 0)
    base = saved_before + in_flight + keep
    fwd = base + np.array([u.fwd_transient_bytes for u in units], dtype=np.int64)
    bwd = base + np.array([u.bwd_transient_bytes for u in units], dtype=np.int64)
    return fwd, bwd


def peak_breakdown(
    profile: ModelProfile, hw: HardwareProfile, knobs: Knobs, tables: ChunkTables | None = None
) -> dict[str, float]:
    """The terms of the predicted peak (bytes); ``predict_peak_bytes`` is its ``"peak"``.

    static   = persist_bytes[p] + optim_bytes_per_param * persist_numel[p] + static_bytes
               (+ persist_grad_total[p] if accumulating)
    grads[u] = offload_grad_bytes[p, u] + persist_grad_bytes[p, u]   (backward only)
               (under the update in the backward, ``persist_grads_in_backward``: the
               persistent grads live at u only, plus one chunk's optimizer temporaries;
               and + ``backward_split.scratch[p, u]``, the state of the chunks the GPU
               updates there)
    fwd[u]   = fwd_act[u] + scratch_bytes[p] + in_flight_fwd[u]   (``activation_events``,
    bwd[u]   = bwd_act[u] + grads[u] + in_flight_bwd[u]    ``chunk_bytes_in_flight``)
    step     = persist_grad_total[p] (unless in static) + optim_step_bytes_per_param
               * persist_numel[p]       (the user's optimizer.step(): activations are gone, the
                                         persistent grads and the optimizer's temporaries live)
               + scratch_bytes[p]       (the GPU update path's, ``plan/update_split.py``)
               (0 under the update in the backward: the persistent chunks were stepped in it)
    allocated = static + max(max_u fwd[u], max_u bwd[u], step)     (bytes live at once)
    pooled   = static + max(max_u fwd_act[u], max_u (bwd_act[u] + grads[u]), step)
               + max_u max(in_flight_fwd[u], in_flight_bwd[u])
    peak     = cuda_context + ceil(fragmentation * pooled)

    ``pooled`` adds the chunk buffers' own peak to the rest's, as reserved memory was when chunk
    buffers had the copy stream's allocator pool (reserved 0.7 GiB over the simultaneous peak,
    8B LoRA at 12 GiB). They share the compute stream's pool now (``runtime/chunks/store.py``), and
    ``pooled`` still met max reserved within 0.4% at 8B LoRA and QLoRA under caps: it stays, a
    bound a little above the simultaneous peak (docs/planner.md, "Pools").
    """
    tables = tables or chunk_tables(profile)
    check_knobs(profile, knobs, tables)
    p = knobs.n_persist
    fwd_act, bwd_act = activation_events(profile, knobs)
    # The GPU update path's scratch lives from step() into the next forward (until its last
    # chunk, which the forward needs late, is back): counted on every forward event.
    scratch = scratch_bytes_of(profile, gpu_update_chunks(profile, hw, p))
    fwd_act = fwd_act + scratch
    in_fwd, in_bwd = chunk_bytes_in_flight(profile, knobs, tables)
    grads = tables.offload_grad_bytes[p].copy()
    static = int(
        tables.persist_bytes[p]
        + profile.optim_bytes_per_param * tables.persist_numel[p]
        + profile.static_bytes
        + accumulate_scratch_bytes(profile)
    )
    if profile.grad_accumulation:
        static += int(tables.persist_grad_total[p])
    grads = grads + persist_grads_in_backward(profile, tables)[p]
    # The optimizer state of the chunks the GPU updates in the backward, while it is there.
    backward_scratch = np.zeros_like(grads)
    if profile.update_in_backward:
        backward_scratch = backward_split(profile, hw, np.array([p])).scratch[0]
    grads = grads + backward_scratch
    fwd, bwd = fwd_act + in_fwd, bwd_act + grads + in_bwd
    fwd_peak, bwd_peak = int(fwd.max()), int(bwd.max())
    in_backward = bwd_peak > fwd_peak
    peak_unit = int(np.argmax(bwd if in_backward else fwd))
    step = optimizer_step_bytes(profile, tables, p) + scratch
    allocated = static + max(fwd_peak, bwd_peak, step)
    chunk_pool = int(max(in_fwd.max(), in_bwd.max()))
    pooled = static + max(int(fwd_act.max()), int((bwd_act + grads).max()), step) + chunk_pool
    frag = profile.fragmentation_factor
    peak = hw.cuda_context_bytes + math.ceil(frag * pooled)
    return {
        "peak": float(peak),
        "context": float(hw.cuda_context_bytes),
        "persistent_weights": float(tables.persist_bytes[p]),
        "persistent_optim_states": float(profile.optim_bytes_per_param * tables.persist_numel[p]),
        "buffers": float((in_bwd if in_backward else in_fwd)[peak_unit]),
        "buffers_max": float(max(in_fwd.max(), in_bwd.max())),
        "static_other": float(profile.static_bytes),
        "activations_fwd_peak": float(fwd_act.max()),
        "activations_bwd_peak": float((bwd_act + grads).max()),
        "peak_in_backward": float(in_backward),
        "optimizer_step": float(step),
        "backward_update_scratch": float(backward_scratch.max()),
        "peak_unit": float(peak_unit),
        "allocated": float(allocated),
        "pooled": float(pooled),
        "fragmentation": frag,
    }


def optimizer_step_bytes(
    profile: ModelProfile, tables: ChunkTables, p: int | np.ndarray
) -> int | np.ndarray:
    """Bytes above ``static`` while the user's optimizer steps the persistent chunks (see
    ``peak_breakdown``); ``p`` an n_persist or an array of them. None where the update in the
    backward stepped them in the backward (``runtime/update/persistent_update.py``)."""
    if profile.persistent_in_backward and not profile.grad_accumulation:
        return 0 * tables.persist_numel[p]
    grads = 0 if profile.grad_accumulation else tables.persist_grad_total[p]
    return grads + profile.optim_step_bytes_per_param * tables.persist_numel[p]


def persist_grads_in_backward(profile: ModelProfile, tables: ChunkTables) -> np.ndarray:
    """Persistent gradient bytes live in each unit's backward beside the activations, per
    n_persist (shape (n_chunks + 1, n_units)): none when accumulating (they are static); under
    the update in the backward those of the persistent chunks live at the unit only, plus the
    optimizer's temporaries for the largest chunk it steps there; else all since their last
    unit's backward."""
    if profile.grad_accumulation:
        return np.zeros_like(tables.persist_grad_bytes)
    if profile.persistent_in_backward:
        temporaries = profile.optim_step_bytes_per_param * tables.persist_numel_max
        return tables.persist_grad_live + temporaries[:, None]
    return tables.persist_grad_bytes


def predict_peak_bytes(profile: ModelProfile, hw: HardwareProfile, knobs: Knobs) -> int:
    """Predicted peak device memory of the process (CUDA context included), bytes."""
    return int(peak_breakdown(profile, hw, knobs)["peak"])
