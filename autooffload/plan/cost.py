"""The cost model: peak device memory and step time of one configuration, as documented formulas.

A configuration is a chunk layout (one ``ModelProfile``, i.e. one ``chunk_size``) plus
``Knobs(n_persist, n_buffer, n_swap, n_checkpoint)``. Units: bytes, seconds, bytes/s.
Notation: ``u`` is an execution unit (0 = pre, 1..L = blocks, L+1 = post, see ``profile_types``),
``p = n_persist`` (chunks ``0 .. p-1`` persistent, chunks ``>= p`` offloaded), ``b = n_buffer``.
docs/planner.md explains every term; ``plan.search`` evaluates the same formulas vectorised and
tests check both agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from autooffload.errors import PlanError
from autooffload.plan.profile_types import HardwareProfile, ModelProfile
from autooffload.plan.types import Knobs

# Below this share of the step, stalls and recompute are noise and the step is compute-bound.
BOTTLENECK_MIN_SHARE = 0.05


def assign_block_policies(n_blocks: int, n_swap: int, n_checkpoint: int) -> tuple[str, ...]:
    """Per-block policy: blocks ``[0, n_swap)`` swap, the next ``n_checkpoint`` checkpoint, the
    rest keep.

    Why this order: a swapped block's activations leave during its forward and are needed back only
    at the very end of the backward, so the first blocks have the most time to hide both copies.
    Their swap-in traffic rides in the backward windows of the blocks just after them, so those are
    the ones checkpointed: their recompute lengthens exactly the windows where PCIe would stall.
    The last blocks keep (their backward comes first, with nothing to overlap a recompute with).
    The rule is nested: one more checkpoint only turns a keep block into a checkpoint block.
    """
    if min(n_swap, n_checkpoint) < 0 or n_swap + n_checkpoint > n_blocks:
        raise PlanError(
            f"n_swap={n_swap} + n_checkpoint={n_checkpoint} must be >= 0 and <= n_blocks={n_blocks}"
        )
    n_keep = n_blocks - n_swap - n_checkpoint
    return ("swap",) * n_swap + ("checkpoint",) * n_checkpoint + ("keep",) * n_keep


def unit_policies(n_blocks: int, n_swap: int, n_checkpoint: int) -> tuple[str, ...]:
    """Policies of all units: pre and post always keep."""
    return ("keep", *assign_block_policies(n_blocks, n_swap, n_checkpoint), "keep")


@dataclass(frozen=True)
class ChunkTables:
    """Chunk traffic and residency per unit as functions of ``n_persist``.

    Every 2-D array has shape ``(n_chunks + 1, n_units)``: row ``p`` is the layout with ``p``
    persistent chunks, so the search can look up any ``n_persist`` without recomputing.
    """

    resident: np.ndarray
    """Offloaded chunks used by unit u (buffers it occupies while it runs)."""
    fwd_gather_count: np.ndarray
    """Offloaded chunks first needed at u in forward (gathered H2D before u)."""
    fwd_gather_bytes: np.ndarray
    bwd_gather_count: np.ndarray
    """Offloaded chunks first needed at u in backward order (gathered H2D before u's backward)."""
    bwd_gather_bytes: np.ndarray
    grad_d2h_bytes: np.ndarray
    """Grad bytes copied D2H after u's backward (offloaded trainable chunks with lowest unit u)."""
    offload_grad_bytes: np.ndarray
    """Offloaded grads live during u's backward: chunks used by u, and by u+1 (D2H in flight)."""
    persist_grad_bytes: np.ndarray
    """Persistent grads live during u's backward: persistent chunks whose highest unit is >= u."""
    cpu_ready_numel: np.ndarray
    """Elements the CPU optimizer updates before u's forward gathers may start; -1: no gather."""
    persist_bytes: np.ndarray
    """Shape (n_chunks + 1,): bytes of the first p chunks."""
    persist_numel: np.ndarray
    """Trainable elements in the first p chunks (the GPU optimizer's work)."""
    persist_grad_total: np.ndarray
    """Grad bytes of the first p chunks."""
    offload_numel: np.ndarray
    """Trainable elements in chunks >= p (the CPU optimizer's work)."""
    min_buffers: np.ndarray
    """Smallest valid ``n_buffer``: max over units of ``resident``, and at least 1."""
    useful_buffers: np.ndarray
    """``n_buffer`` above which the model predicts no gain: every prefetch fits beside the
    running unit's chunks."""


def chunk_tables(profile: ModelProfile) -> ChunkTables:
    """Tabulate the chunk layout for every ``n_persist`` (O(n_chunks * n_units))."""
    n_chunks, n_units = profile.n_chunks, profile.n_units
    used = np.zeros((n_chunks, n_units), dtype=bool)
    for index, chunk in enumerate(profile.chunks):
        used[index, list(chunk.units)] = True
    size = np.array([c.bytes for c in profile.chunks], dtype=np.int64)
    grad = np.array([c.trainable_bytes for c in profile.chunks], dtype=np.int64)
    numel = np.array([c.trainable_numel for c in profile.chunks], dtype=np.int64)

    used_before = np.zeros_like(used)
    used_before[:, 1:] = used[:, :-1]
    used_after = np.zeros_like(used)
    used_after[:, :-1] = used[:, 1:]
    fwd_gather = used & ~used_before
    bwd_gather = used & ~used_after
    lowest = np.zeros_like(used)
    lowest[np.arange(n_chunks), [c.units[0] for c in profile.chunks]] = True
    highest_at_or_after = np.zeros((n_chunks, n_units), dtype=bool)
    for index, chunk in enumerate(profile.chunks):
        highest_at_or_after[index, : chunk.units[-1] + 1] = True

    def from_p(values: np.ndarray) -> np.ndarray:
        """Row p = sum over offloaded chunks c >= p."""
        suffix = np.cumsum(values[::-1], axis=0)[::-1]
        return np.concatenate([suffix, np.zeros((1, *values.shape[1:]), values.dtype)])

    def below_p(values: np.ndarray) -> np.ndarray:
        """Row p = sum over persistent chunks c < p."""
        prefix = np.cumsum(values, axis=0)
        return np.concatenate([np.zeros((1, *values.shape[1:]), values.dtype), prefix])

    resident = from_p(used.astype(np.int64))
    fwd_count = from_p(fwd_gather.astype(np.int64))
    bwd_count = from_p(bwd_gather.astype(np.int64))

    # The CPU optimizer updates offloaded chunks in forward order from chunk p; a forward gather
    # at u waits for its highest chunk: cpu_ready_numel[p, u] = sum(numel[p .. last_u]).
    numel_prefix = np.concatenate([[0], np.cumsum(numel)])
    last_gathered = np.array(
        [int(np.flatnonzero(fwd_gather[:, u]).max(initial=-1)) for u in range(n_units)]
    )
    rows = np.arange(n_chunks + 1)[:, None]
    ready = numel_prefix[last_gathered + 1][None, :] - numel_prefix[rows]
    ready = np.where(last_gathered[None, :] >= rows, ready, -1)

    max_resident = resident.max(axis=1)
    fwd_next = np.zeros_like(fwd_count)
    fwd_next[:, :-1] = fwd_count[:, 1:]
    bwd_prev = np.zeros_like(bwd_count)
    bwd_prev[:, 1:] = bwd_count[:, :-1]
    min_buffers = np.maximum(max_resident, 1)
    useful = np.maximum(min_buffers, np.maximum(resident + fwd_next, resident + bwd_prev).max(1))
    return ChunkTables(
        resident=resident,
        fwd_gather_count=fwd_count,
        fwd_gather_bytes=from_p(fwd_gather * size[:, None]),
        bwd_gather_count=bwd_count,
        bwd_gather_bytes=from_p(bwd_gather * size[:, None]),
        grad_d2h_bytes=from_p(lowest * grad[:, None]),
        offload_grad_bytes=from_p((used | used_after) * grad[:, None]),
        persist_grad_bytes=below_p(highest_at_or_after * grad[:, None]),
        cpu_ready_numel=ready,
        persist_bytes=below_p(size),
        persist_numel=below_p(numel),
        persist_grad_total=below_p(grad),
        offload_numel=from_p(numel),
        min_buffers=min_buffers,
        useful_buffers=useful,
    )


def check_knobs(profile: ModelProfile, knobs: Knobs, tables: ChunkTables | None = None) -> None:
    """Raise ``PlanError`` naming the knob if ``knobs`` is outside its valid range."""
    tables = tables or chunk_tables(profile)
    if not 0 <= knobs.n_persist <= profile.n_chunks:
        raise PlanError(
            f"n_persist={knobs.n_persist} is out of range; valid: 0..{profile.n_chunks} chunks"
        )
    min_buffers = int(tables.min_buffers[knobs.n_persist])
    if knobs.n_buffer < min_buffers:
        raise PlanError(
            f"n_buffer={knobs.n_buffer} is too small for n_persist={knobs.n_persist}: one unit"
            f" needs {min_buffers} offloaded chunks at once; valid: n_buffer >= {min_buffers}"
        )
    assign_block_policies(profile.n_blocks, knobs.n_swap, knobs.n_checkpoint)


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

    static  = persist_bytes[p] + optim_bytes_per_param * persist_numel[p]
              + n_buffer * chunk_size + static_bytes (+ persist_grad_total[p] if accumulating)
    grads[u] = offload_grad_bytes[p, u] + persist_grad_bytes[p, u]   (backward only)
    dynamic = max(max_u fwd[u], max_u (bwd[u] + grads[u]))            (see ``activation_events``)
    peak    = cuda_context + ceil(fragmentation * (static + dynamic))
    """
    tables = tables or chunk_tables(profile)
    check_knobs(profile, knobs, tables)
    p = knobs.n_persist
    fwd, bwd = activation_events(profile, knobs)
    grads = tables.offload_grad_bytes[p].copy()
    static = int(
        tables.persist_bytes[p]
        + profile.optim_bytes_per_param * tables.persist_numel[p]
        + knobs.n_buffer * profile.chunk_size
        + profile.static_bytes
    )
    if profile.grad_accumulation:
        static += int(tables.persist_grad_total[p])
    else:
        grads = grads + tables.persist_grad_bytes[p]
    fwd_peak, bwd_peak = int(fwd.max()), int((bwd + grads).max())
    allocated = static + max(fwd_peak, bwd_peak)
    frag = profile.fragmentation_factor
    peak = hw.cuda_context_bytes + math.ceil(frag * allocated)
    return {
        "peak": float(peak),
        "context": float(hw.cuda_context_bytes),
        "persistent_weights": float(tables.persist_bytes[p]),
        "persistent_optim_states": float(profile.optim_bytes_per_param * tables.persist_numel[p]),
        "buffers": float(knobs.n_buffer * profile.chunk_size),
        "static_other": float(profile.static_bytes),
        "activations_fwd_peak": float(fwd_peak),
        "activations_bwd_peak": float(bwd_peak),
        "peak_in_backward": float(bwd_peak > fwd_peak),
        "allocated": float(allocated),
        "fragmentation": frag,
    }


def predict_peak_bytes(profile: ModelProfile, hw: HardwareProfile, knobs: Knobs) -> int:
    """Predicted peak device memory of the process (CUDA context included), bytes."""
    return int(peak_breakdown(profile, hw, knobs)["peak"])


def transfer_s(h2d_bytes: float, d2h_bytes: float, hw: HardwareProfile) -> float:
    """Time to move both directions at once: max(h2d/B_h2d, d2h/B_d2h, (h2d+d2h)/B_duplex) s."""
    return max(
        h2d_bytes / hw.h2d_bps, d2h_bytes / hw.d2h_bps, (h2d_bytes + d2h_bytes) / hw.duplex_bps
    )


def _prefetch_share(count: int, free_buffers: int) -> float:
    """Share of a unit's gathers that fit in the buffers left while the previous unit runs."""
    return 1.0 if count == 0 else min(1.0, max(0.0, free_buffers / count))


def predict_step_time(
    profile: ModelProfile, hw: HardwareProfile, knobs: Knobs, tables: ChunkTables | None = None
) -> tuple[float, dict[str, float], str]:
    """Predicted seconds per step, its breakdown, and the bottleneck's name.

    Time 0 is ``optimizer.step()`` of the previous step. Per forward window u (unit u computes,
    the gathers of u+1 prefetch into the buffers u leaves free, u's swapped activations go out):
        share      = min(1, (n_buffer - resident[u]) / gathers[u+1])
        xfer_f[u]  = transfer_s(share * gather_bytes[u+1], swap_out[u])
        w_f[u]     = max(fwd_s[u], xfer_f[u]) + (1 - share) * gather_bytes[u+1] / B_h2d      (s)
    The CPU optimizer updates offloaded chunks in order from t=0; gathers of u wait for them:
        ready[u]   = cpu_ready_numel[u] / cpu_rate + gather_bytes[u] / B_h2d
        T_fwd      = max(max(gpu_optim, gather_bytes[0] / B_h2d) + sum_u w_f[u],
                         max_u (ready[u] + sum_{v >= u} w_f[v]))                             (s)
    with gpu_optim = persist_numel / gpu_rate (the user's optimizer on persistent chunks).
    Per backward window u (reverse order; prefetch gathers and swap-in of u-1, grads of u+1 out):
        xfer_b[u]  = transfer_s(share * bwd_gather_bytes[u-1] + swap_in[u-1], grad_d2h[u+1])
        w_b[u]     = max(bwd_s[u] + recompute[u], xfer_b[u]) + (1 - share) * bwd_gather[u-1]/B_h2d
        T_bwd      = bwd_gather_bytes[L+1] / B_h2d + sum_u w_b[u] + grad_d2h[0] / B_d2h      (s)
    step = T_fwd + T_bwd + other_s.
    """
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
        gathers = tables.fwd_gather_count[p, u + 1] if u + 1 < n_units else 0
        gather_bytes = float(tables.fwd_gather_bytes[p, u + 1]) if u + 1 < n_units else 0.0
        share = _prefetch_share(gathers, n_buffer - resident[u])
        swap_out = float(units[u].act_bytes_keep) if policies[u] == "swap" else 0.0
        exposed = (1.0 - share) * gather_bytes / hw.h2d_bps
        fwd_windows.append(window(units[u].fwd_s, share * gather_bytes, swap_out, exposed))
    gpu_optim_s = float(tables.persist_numel[p]) / hw.gpu_optim_params_per_s
    first_gather_s = float(tables.fwd_gather_bytes[p, 0]) / hw.h2d_bps
    stalls["pcie_h2d"] += max(0.0, first_gather_s - gpu_optim_s)
    unconstrained = max(gpu_optim_s, first_gather_s) + sum(fwd_windows)
    suffix = np.cumsum(fwd_windows[::-1])[::-1]
    t_fwd = unconstrained
    for u in range(n_units):
        if tables.cpu_ready_numel[p, u] >= 0:
            ready = tables.cpu_ready_numel[p, u] / hw.cpu_optim_params_per_s
            ready += float(tables.fwd_gather_bytes[p, u]) / hw.h2d_bps
            t_fwd = max(t_fwd, ready + float(suffix[u]))
    stalls["cpu_optimizer"] = t_fwd - unconstrained

    bwd_windows = []
    recompute_s = 0.0
    for u in range(n_units):
        gathers = tables.bwd_gather_count[p, u - 1] if u > 0 else 0
        gather_bytes = float(tables.bwd_gather_bytes[p, u - 1]) if u > 0 else 0.0
        share = _prefetch_share(gathers, n_buffer - resident[u])
        swap_in = float(units[u - 1].act_bytes_keep) if u > 0 and policies[u - 1] == "swap" else 0.0
        grads_out = float(tables.grad_d2h_bytes[p, u + 1]) if u + 1 < n_units else 0.0
        recompute = units[u].fwd_s if policies[u] == "checkpoint" else 0.0
        recompute_s += recompute
        exposed = (1.0 - share) * gather_bytes / hw.h2d_bps
        compute = units[u].bwd_s + recompute
        bwd_windows.append(window(compute, share * gather_bytes + swap_in, grads_out, exposed))
    head_s = float(tables.bwd_gather_bytes[p, n_units - 1]) / hw.h2d_bps
    tail_s = float(tables.grad_d2h_bytes[p, 0]) / hw.d2h_bps
    stalls["pcie_h2d"] += head_s
    stalls["pcie_d2h"] += tail_s
    t_bwd = head_s + sum(bwd_windows) + tail_s
    step_s = t_fwd + t_bwd + profile.other_s

    swap_bytes = sum(u.act_bytes_keep for u, pol in zip(units, policies) if pol == "swap")
    breakdown = {
        "step_s": step_s,
        "fwd_s": t_fwd,
        "bwd_s": t_bwd,
        "fwd_compute_s": sum(u.fwd_s for u in units),
        "bwd_compute_s": sum(u.bwd_s for u in units),
        "recompute_s": recompute_s,
        "gpu_optim_s": gpu_optim_s,
        "cpu_optim_s": float(tables.offload_numel[p]) / hw.cpu_optim_params_per_s,
        "other_s": profile.other_s,
        "h2d_stall_s": stalls["pcie_h2d"],
        "d2h_stall_s": stalls["pcie_d2h"],
        "cpu_optim_stall_s": stalls["cpu_optimizer"],
        "h2d_bytes": float(tables.fwd_gather_bytes[p].sum() + tables.bwd_gather_bytes[p].sum())
        + swap_bytes,
        "d2h_bytes": float(tables.grad_d2h_bytes[p].sum()) + swap_bytes,
        "swap_bytes": float(swap_bytes),
        "tokens_per_s": profile.batch_tokens / step_s if step_s > 0 else math.inf,
    }
    breakdown = {key: float(value) for key, value in breakdown.items()}
    return float(step_s), breakdown, _bottleneck(step_s, recompute_s, stalls)


def _bottleneck(step_s: float, recompute_s: float, stalls: dict[str, float]) -> str:
    """The largest of the stalls and the recompute, or "compute" if none reaches 5% of the step."""
    costs = {**stalls, "recompute": recompute_s}
    name = max(costs, key=costs.__getitem__)
    return name if costs[name] >= BOTTLENECK_MIN_SHARE * step_s else "compute"


def calibrate(
    model_profile: ModelProfile,
    measured_peak: int,
    predicted_peak: int,
    cuda_context_bytes: int = 0,
) -> float:
    """New fragmentation factor for ``model_profile.weight_dtype`` from one measured step.

    Both peaks include the CUDA context (``cuda_context_bytes``, from the HardwareProfile used):
        allocated = (predicted - context) / f_old
        f_new     = max(1, (measured - context) / allocated)
    Use it with ``model_profile.with_fragmentation(f_new)`` and re-plan.
    """
    old = model_profile.fragmentation_factor
    predicted_alloc = (predicted_peak - cuda_context_bytes) / old
    if predicted_alloc <= 0:
        raise PlanError(
            f"predicted_peak={predicted_peak} is not above cuda_context_bytes={cuda_context_bytes};"
            " pass the peak predict_peak_bytes returned and the same context bytes"
        )
    return max(1.0, (measured_peak - cuda_context_bytes) / predicted_alloc)
