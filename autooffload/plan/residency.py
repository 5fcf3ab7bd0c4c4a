"""Which offloaded chunks are on the device at once: chunk spans and the runtime's prefetch order.

The runtime (``runtime/hooks.py``) gathers a group's chunks before it runs, releases a chunk when
no later group needs it, and prefetches the chunks that come next while fewer than ``n_buffer``
offloaded chunks are on the device. ``prefetch_queue`` states that order for one unit;
``queued_bytes`` is its vectorised form for the search. ``chunk_tables`` tabulates residency and
traffic per unit for every ``n_persist``, and ``chunk_bytes_in_flight`` the chunk bytes on the
device per unit for one configuration; ``cost_memory`` and ``cost_time`` build on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autooffload.plan.profile_types import HardwareProfile, ModelProfile
from autooffload.plan.types import Knobs


def transfer_s(h2d_bytes: float, d2h_bytes: float, hw: HardwareProfile) -> float:
    """Time to move both directions at once: max(h2d/B_h2d, d2h/B_d2h, (h2d+d2h)/B_duplex) s."""
    return max(
        h2d_bytes / hw.h2d_bps, d2h_bytes / hw.d2h_bps, (h2d_bytes + d2h_bytes) / hw.duplex_bps
    )


def chunk_spans(profile: ModelProfile) -> tuple[np.ndarray, np.ndarray]:
    """First and last unit of every chunk: the runtime keeps a gathered chunk on the device
    until no later group needs it, so it is live over the whole span."""
    first = np.array([c.units[0] for c in profile.chunks], dtype=np.int64)
    last = np.array([c.units[-1] for c in profile.chunks], dtype=np.int64)
    return first, last


def prefetch_queue(profile: ModelProfile, n_persist: int, unit: int, forward: bool) -> list[int]:
    """Offloaded chunks the runtime prefetches next while ``unit`` runs, in its order.

    Chunks served from the host (``ChunkProfile.served``) are never gathered, so never queued.
    Forward: chunks first needed after ``unit``, by first unit (then index). Backward: chunks last
    needed before ``unit`` that a backward reads (``ChunkProfile.backward``), latest first (then
    highest index first), as the runtime walks groups and their chunks in reverse. It takes them
    from the front while fewer than ``n_buffer`` offloaded chunks are on the device.
    """
    first, last = chunk_spans(profile)
    chunks = [c for c in range(n_persist, profile.n_chunks) if not profile.chunks[c].served]
    if forward:
        return sorted((c for c in chunks if first[c] > unit), key=lambda c: (first[c], c))
    read = [c for c in chunks if last[c] < unit and profile.chunks[c].backward]
    return sorted(read, key=lambda c: (-last[c], -c))


def queued_bytes(
    profile: ModelProfile,
    persist: np.ndarray,
    fwd_rooms: list[np.ndarray],
    bwd_rooms: list[np.ndarray],
) -> list[list[np.ndarray]]:
    """Bytes of the first ``room[p, d, u]`` chunks of ``prefetch_queue`` at each unit, for
    every room array given (forward ones, backward ones), each of shape (P, D, U).

    Per n_persist row p, the queue order restricted to chunks >= p is one sequence; the chunks live
    at or passed by unit u are its first ``seen[p, u]``, so a window is a prefix-sum difference.
    """
    first, last = chunk_spans(profile)
    size = np.array([c.bytes for c in profile.chunks], dtype=np.int64)
    served = np.array([c.served for c in profile.chunks], dtype=bool)
    read = np.array([c.backward for c in profile.chunks], dtype=bool) & ~served
    units = np.arange(profile.n_units)
    index = np.arange(profile.n_chunks)
    fwd_order = np.lexsort((index, first))
    bwd_order = np.lexsort((-index, -last))
    plans = [
        (fwd_order[~served[fwd_order]], (first[:, None] <= units) & ~served[:, None], fwd_rooms),
        (bwd_order[read[bwd_order]], (last[:, None] >= units) & read[:, None], bwd_rooms),
    ]
    results = []
    for order, passed, rooms in plans:
        # seen[p, u]: chunks >= p that are live at u or behind it in this direction.
        seen = np.cumsum(passed[::-1], axis=0)[::-1]
        seen = np.concatenate([seen, np.zeros((1, profile.n_units), np.int64)])[persist]
        out = [np.zeros(room.shape, dtype=np.int64) for room in rooms]
        for row, p in enumerate(persist):
            chunks = order[order >= p]
            prefix = np.concatenate([[0], np.cumsum(size[chunks])])
            start = seen[row]
            for result, room in zip(out, rooms):
                stop = np.minimum(start + room[row], chunks.size)
                result[row] = prefix[stop] - prefix[start]
        results.append(out)
    return results


@dataclass(frozen=True)
class ChunkTables:
    """Chunk traffic and residency per unit as functions of ``n_persist``.

    Every 2-D array has shape ``(n_chunks + 1, n_units)``: row ``p`` is the layout with ``p``
    persistent chunks, so the search can look up any ``n_persist`` without recomputing. A chunk is
    *live* from its first unit to its last: the runtime releases a chunk only when no later group
    needs it (a tied embedding stays on the device from the embedding to the head).
    """

    resident: np.ndarray
    """Offloaded chunks live at unit u (buffers they occupy while it runs)."""
    resident_bytes: np.ndarray
    """Bytes of the offloaded chunks live at unit u."""
    fwd_gather_count: np.ndarray
    """Offloaded chunks first needed at u in forward (gathered H2D before u)."""
    fwd_gather_bytes: np.ndarray
    bwd_gather_count: np.ndarray
    """Offloaded chunks gathered H2D before u's backward: those whose span ends at u, if a
    backward reads them; none at the post unit, whose chunks stay from its forward."""
    bwd_gather_bytes: np.ndarray
    grad_d2h_bytes: np.ndarray
    """Grad bytes copied D2H after u's backward (offloaded trainable chunks with lowest unit u)."""
    offload_grad_bytes: np.ndarray
    """Offloaded grads live during u's backward: chunks live at u, or at u+1 (D2H in flight)."""
    persist_grad_bytes: np.ndarray
    """Persistent grads live during u's backward: persistent chunks whose highest unit is >= u."""
    persist_grad_done: np.ndarray
    """Persistent grads complete after u's backward (persistent chunks with lowest unit u): under
    data parallelism their all-reduce starts then."""
    persist_grad_live: np.ndarray
    """Persistent grads live during u's backward under the update in the backward, which steps a
    persistent chunk and drops its grads once the backward is past its lowest unit
    (``runtime/update/persistent_update.py``): persistent chunks live at u."""
    cpu_ready_numel: np.ndarray
    """Elements the CPU optimizer updates before u's forward gathers may start; -1: no gather."""
    persist_bytes: np.ndarray
    """Shape (n_chunks + 1,): bytes of the first p chunks."""
    persist_numel: np.ndarray
    """Trainable elements in the first p chunks (the GPU optimizer's work)."""
    persist_grad_total: np.ndarray
    """Grad bytes of the first p chunks."""
    persist_numel_max: np.ndarray
    """Shape (n_chunks + 1,): the most trainable elements of one of the first p chunks."""
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
    first, last = chunk_spans(profile)
    unit_index = np.arange(n_units)
    # A chunk served from the host is never on the device whole: live nowhere, of no bytes.
    served = np.array([c.served for c in profile.chunks], dtype=bool)
    live = (first[:, None] <= unit_index) & (unit_index <= last[:, None]) & ~served[:, None]
    size = np.where(served, 0, np.array([c.bytes for c in profile.chunks], dtype=np.int64))
    grad = np.array([c.trainable_bytes for c in profile.chunks], dtype=np.int64)
    numel = np.array([c.trainable_numel for c in profile.chunks], dtype=np.int64)

    live_before = np.zeros_like(live)
    live_before[:, 1:] = live[:, :-1]
    live_after = np.zeros_like(live)
    live_after[:, :-1] = live[:, 1:]
    fwd_gather = live & ~live_before
    # A backward gathers a chunk where its span ends, if it reads it at all; the post unit's
    # chunks stay on the device from its forward into the backward, which starts with them.
    read = np.array([c.backward for c in profile.chunks], dtype=bool)
    bwd_gather = live & ~live_after & read[:, None]
    bwd_gather[:, n_units - 1] = False
    lowest = np.zeros_like(live)
    lowest[np.arange(n_chunks), first] = True
    highest_at_or_after = unit_index <= last[:, None]

    def from_p(values: np.ndarray) -> np.ndarray:
        """Row p = sum over offloaded chunks c >= p."""
        suffix = np.cumsum(values[::-1], axis=0)[::-1]
        return np.concatenate([suffix, np.zeros((1, *values.shape[1:]), values.dtype)])

    def below_p(values: np.ndarray) -> np.ndarray:
        """Row p = sum over persistent chunks c < p."""
        prefix = np.cumsum(values, axis=0)
        return np.concatenate([np.zeros((1, *values.shape[1:]), values.dtype), prefix])

    resident = from_p(live.astype(np.int64))
    resident_bytes = from_p(live * size[:, None])
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
        resident_bytes=resident_bytes,
        fwd_gather_count=fwd_count,
        fwd_gather_bytes=from_p(fwd_gather * size[:, None]),
        bwd_gather_count=bwd_count,
        bwd_gather_bytes=from_p(bwd_gather * size[:, None]),
        grad_d2h_bytes=from_p(lowest * grad[:, None]),
        offload_grad_bytes=from_p((live | live_after) * grad[:, None]),
        persist_grad_bytes=below_p(highest_at_or_after * grad[:, None]),
        persist_grad_done=below_p(lowest * grad[:, None]),
        persist_grad_live=below_p(live * grad[:, None]),
        cpu_ready_numel=ready,
        persist_bytes=below_p(size),
        persist_numel=below_p(numel),
        persist_grad_total=below_p(grad),
        persist_numel_max=np.concatenate([[0], np.maximum.accumulate(numel)]).astype(np.int64),
        offload_numel=from_p(numel),
        min_buffers=min_buffers,
        useful_buffers=useful,
    )


def chunk_bytes_in_flight(
    profile: ModelProfile, knobs: Knobs, tables: ChunkTables | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Offloaded chunk bytes on the device while each unit runs, in forward and in backward.

    The live chunks of u, then as many prefetched chunks as ``n_buffer`` leaves room for, each
    at its own size (the runtime resizes a chunk's storage to its bytes on gather and to 0 on
    release; the caching allocator is the buffer pool):
        in_flight[u] = resident_bytes[p,u] + sum(bytes[c] for c in queue(u)[:b - resident[p,u]])
    with ``queue`` = ``prefetch_queue`` (forward or backward order), b = n_buffer.    (bytes)
    """
    tables = tables or chunk_tables(profile)
    p, n_buffer = knobs.n_persist, knobs.n_buffer
    size = [c.bytes for c in profile.chunks]
    in_flight = np.zeros((2, profile.n_units), dtype=np.int64)
    for row, forward in enumerate((True, False)):
        for u in range(profile.n_units):
            room = max(0, n_buffer - int(tables.resident[p, u]))
            queued = prefetch_queue(profile, p, u, forward)[:room]
            in_flight[row, u] = tables.resident_bytes[p, u] + sum(size[c] for c in queued)
    return in_flight[0], in_flight[1]
