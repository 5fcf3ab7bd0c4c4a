"""The runtime's prefetch order: the search's vectorised windows equal the scalar queue."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from plan_profiles import MiB, make_profile

from autooffload.plan.profile_types import ChunkProfile
from autooffload.plan.residency import prefetch_queue, queued_bytes


def _scalar(profile, p, rooms, forward):
    sizes = [c.bytes for c in profile.chunks]
    out = np.zeros(rooms.shape, dtype=np.int64)
    for d, u in np.ndindex(*rooms.shape):
        queue = prefetch_queue(profile, p, u, forward)
        out[d, u] = sum(sizes[c] for c in queue[: rooms[d, u]])
    return out


@pytest.mark.parametrize("kind", ["plain", "tied", "oversized", "shared", "frozen_pre"])
def test_queued_bytes_equal_the_prefetch_queue(kind):
    if kind == "frozen_pre":
        # No backward reads the pre unit's own chunks: they leave the backward queue.
        profile = make_profile(n_blocks=4, seed=3, edge_bytes=200 * MiB, lora=True)
        chunks = [replace(c, backward=c.units != (0,)) for c in profile.chunks]
        profile = replace(profile, chunks=tuple(chunks))
    elif kind == "shared":
        # A chunk used by the pre unit and block 2 (a shared module): not in execution order.
        profile = make_profile(n_blocks=4, seed=3)
        shared = ChunkProfile(5 * MiB, units=(0, 3))
        profile = replace(profile, chunks=(*profile.chunks, shared))
    else:
        kwargs = {"tied": {"tied": True}, "oversized": {"edge_bytes": 200 * MiB}}.get(kind, {})
        profile = make_profile(n_blocks=4, seed=3, **kwargs)
    persist = np.arange(profile.n_chunks + 1)
    rng = np.random.default_rng(0)
    shape = (persist.size, 3, profile.n_units)
    rooms = [rng.integers(0, profile.n_chunks + 2, shape), np.zeros(shape, dtype=np.int64)]
    (fwd_a, fwd_b), (bwd_a, bwd_b) = queued_bytes(profile, persist, rooms, rooms)
    assert not fwd_b.any() and not bwd_b.any()
    for row, p in enumerate(persist):
        assert (fwd_a[row] == _scalar(profile, p, rooms[0][row], True)).all()
        assert (bwd_a[row] == _scalar(profile, p, rooms[0][row], False)).all()
