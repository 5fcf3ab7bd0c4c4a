"""Which offloaded chunks are on the device at once: chunk spans and the runtime's prefetch order.

The runtime (``runtime/runtime.py``) gathers a group's chunks before it runs, releases a chunk when
no later group needs it, and prefetches the chunks that come next while fewer than ``n_buffer``
offloaded chunks are on the device. ``prefetch_queue`` states that order for one unit;
``queued_bytes`` is its vectorised form for the search. ``cost`` builds memory and traffic on them.
"""

from __future__ import annotations

import numpy as np

from autooffload.plan.profile_types import ModelProfile


def chunk_spans(profile: ModelProfile) -> tuple[np.ndarray, np.ndarray]:
    """First and last unit of every chunk: the runtime keeps a gathered chunk on the device
    until no later group needs it, so it is live over the whole span."""
    first = np.array([c.units[0] for c in profile.chunks], dtype=np.int64)
    last = np.array([c.units[-1] for c in profile.chunks], dtype=np.int64)
    return first, last


def prefetch_queue(profile: ModelProfile, n_persist: int, unit: int, forward: bool) -> list[int]:
    """Offloaded chunks the runtime prefetches next while ``unit`` runs, in its order.

    Forward: chunks first needed after ``unit``, by first unit (then index). Backward: chunks last
    needed before ``unit`` that a backward reads (``ChunkProfile.backward``), latest first (then
    highest index first), as the runtime walks groups and their chunks in reverse. It takes them
    from the front while fewer than ``n_buffer`` offloaded chunks are on the device.
    """
    first, last = chunk_spans(profile)
    chunks = range(n_persist, profile.n_chunks)
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
    read = np.array([c.backward for c in profile.chunks], dtype=bool)
    units = np.arange(profile.n_units)
    index = np.arange(profile.n_chunks)
    bwd_order = np.lexsort((-index, -last))
    plans = [
        (np.lexsort((index, first)), first[:, None] <= units, fwd_rooms),
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
