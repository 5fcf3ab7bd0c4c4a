"""What the chunk store and its gradient offload count and wait on: the copy counters and, per
chunk, the future of the last CPU-side work on its host bytes."""

from __future__ import annotations

import time
from concurrent.futures import Future

import torch


class CopyStats(dict[str, float]):
    """One model's chunk copy counters by name (bytes, seconds, gathers, stalls). A copy timed
    by CUDA events is added once its end event is done (``fold``): reading it sooner would
    wait for the copy."""

    def __init__(self) -> None:
        super().__init__(
            h2d_bytes=0,
            d2h_bytes=0,
            h2d_s=0.0,
            d2h_s=0.0,
            stall_s=0.0,
            # Sharded chunks: from the copy's start to the broadcast's end, every rank.
            gather_s=0.0,
            gathers=0,
            broadcast_bytes=0,
            # Gradient accumulation on the GPU: elements summed there, bytes of sums copied in.
            summed_params=0,
            sum_h2d_bytes=0,
        )
        # (stat, start, end) CUDA events of copies not yet added.
        self._timed: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def time(self, stat: str, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        """Add the seconds between ``start`` and ``end`` to ``stat`` once ``end`` is done."""
        self._timed.append((stat, start, end))

    def fold(self, wait: bool = False) -> None:
        """Add the durations of the timed copies that finished (all of them if ``wait``)."""
        pending = []
        for stat, start, end in self._timed:
            if wait or end.query():
                end.synchronize()
                self[stat] += start.elapsed_time(end) / 1e3
            else:
                pending.append((stat, start, end))
        self._timed = pending


class ChunkFutures:
    """Per chunk, the future of the last CPU-side work on one kind of its host bytes (its
    weights, its gradient staging); a copy that touches those bytes waits for it first."""

    def __init__(self, n_chunks: int, stats: CopyStats) -> None:
        self._futures: list[Future | None] = [None] * n_chunks
        self._stats = stats

    def set(self, index: int, future: Future) -> None:
        """``future`` is now the last work on chunk ``index``'s bytes (it runs after the rest)."""
        self._futures[index] = future

    def get(self, index: int) -> Future | None:
        """The last work on chunk ``index``'s bytes not waited for yet, if any."""
        return self._futures[index]

    def wait(self, index: int) -> None:
        """Block until chunk ``index``'s last work is done; the time counts as a stall."""
        future = self._futures[index]
        self._futures[index] = None
        if future is not None:
            # A done future is read too: an update that failed raises here (once), where its
            # chunk is next needed, instead of the chunk being used with stale bytes.
            start = time.perf_counter()
            future.result()
            self._stats["stall_s"] += time.perf_counter() - start

    def wait_all(self) -> None:
        """``wait`` for every chunk."""
        for index in range(len(self._futures)):
            self.wait(index)
