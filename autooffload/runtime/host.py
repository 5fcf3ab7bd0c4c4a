"""Host store: one pinned CPU allocation holding every chunk's compute copy, freed on detach."""

from __future__ import annotations

import torch

from autooffload.log import logger, warn_once


class HostArena:
    """A single host byte buffer carved into per-chunk views.

    One allocation instead of one per chunk: ``cudaHostAlloc`` is slow and fragments the
    pinned pool. If pinning fails (locked-memory limits, container caps) the arena falls back
    to pageable memory with one warning, since pageable copies are ~3x slower but correct.
    """

    def __init__(self, sizes: list[int], pin: bool) -> None:
        self.offsets: list[int] = []
        total = 0
        for size in sizes:
            self.offsets.append(total)
            total += size
        self.total_bytes = total
        self.pinned = False
        self.buffer = torch.empty(0, dtype=torch.uint8)
        if total == 0:
            return
        if pin:
            try:
                self.buffer = torch.empty(total, dtype=torch.uint8, pin_memory=True)
                self.pinned = True
            except RuntimeError as exc:
                warn_once(
                    "host-pin-failed",
                    f"autooffload: pinning {total / (1 << 30):.2f} GiB of host memory failed"
                    f" ({exc});"
                    " using pageable memory, transfers will be slower. Raise the memlock limit"
                    " (ulimit -l) to restore pinned transfers.",
                )
        if not self.pinned:
            self.buffer = torch.empty(total, dtype=torch.uint8)
        logger.debug(
            "host arena: %.2f GiB (%s)", total / (1 << 30), "pinned" if self.pinned else "pageable"
        )
        self.sizes = sizes

    def view(self, index: int) -> torch.Tensor:
        """The byte view of chunk ``index``."""
        start = self.offsets[index]
        return self.buffer[start : start + self.sizes[index]]

    def free(self) -> None:
        """Drop the allocation (views taken earlier keep their memory alive until dropped)."""
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.offsets = []
        self.sizes = []
        self.total_bytes = 0
