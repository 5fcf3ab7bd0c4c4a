"""Host store: a few pinned CPU allocations holding every chunk's compute copy, freed on detach."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from autooffload.log import logger, warn_once


def power_of_two_pieces(sizes: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Lay ``sizes`` (bytes, in order) out in pieces sized for torch's pinned allocator, which
    rounds every allocation up to a power of two: each piece is filled up to the largest power
    of two at most the bytes still to place (at least the next size's power of two). Returns the
    bytes each piece holds and, per size, its (piece, offset). 24 chunks of 416 MiB take 8, 2
    and 0.5 GiB pieces (10.5 GiB pinned) instead of one 9.75 GiB allocation rounded to 16."""
    pieces: list[int] = []
    place: list[tuple[int, int]] = []
    remaining = sum(sizes)
    capacity = used = 0
    for size in sizes:
        if size and (not pieces or used + size > capacity):
            if pieces:
                pieces[-1] = used
            capacity = max(1 << (remaining.bit_length() - 1), 1 << (size - 1).bit_length())
            pieces.append(0)
            used = 0
        place.append((max(0, len(pieces) - 1), used))
        used += size
        remaining -= size
    if pieces:
        pieces[-1] = used
    return pieces, place


class HostArena:
    """A few host byte buffers carved into per-chunk views.

    Few allocations instead of one per chunk: ``cudaHostAlloc`` is slow and fragments the
    pinned pool; and not one for all, since torch's pinned allocator rounds an allocation up to
    a power of two (up to 1.6x the bytes pinned, all resident): ``power_of_two_pieces``. If
    pinning fails (locked-memory limits, container caps) the arena falls back to pageable
    memory with one warning, since pageable copies are ~3x slower but correct. ``lazy``:
    allocate at the first view taken (the gradient staging of a model that may never train: a
    reference model loaded with its params requiring grad, used under no_grad).
    """

    def __init__(self, sizes: list[int], pin: bool, lazy: bool = False) -> None:
        self.piece_bytes, self.place = power_of_two_pieces(sizes)
        self.total_bytes = sum(sizes)
        self.sizes = sizes
        self.pinned = False
        self.pieces: list[torch.Tensor] = []
        self._arrays: list[np.ndarray | None] = []  # the pieces as numpy, for ``alias``
        self._pin = pin
        self._lock = threading.Lock()  # the first view may be taken on the optimizer's worker
        if self.total_bytes == 0:
            self.pinned = pin  # nothing to pin: report what was asked (a rank hosting no chunk)
            return
        if not lazy:
            self._allocate()

    @property
    def allocated(self) -> bool:
        """Whether the bytes exist (a lazy arena has none before its first view)."""
        return bool(self.pieces)

    def contains(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s first byte lies in the arena."""
        ptr = tensor.data_ptr()
        return any(p.data_ptr() <= ptr < p.data_ptr() + p.numel() for p in self.pieces)

    def _ensure(self) -> None:
        """Allocate a lazy arena's bytes, once, whichever thread asks first."""
        if not self.pieces and self.total_bytes:
            with self._lock:
                if not self.pieces:
                    self._allocate()

    def _allocate(self) -> None:
        total = self.total_bytes
        if self._pin:
            try:
                pieces = [
                    torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in self.piece_bytes
                ]
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
            pieces = [torch.empty(n, dtype=torch.uint8) for n in self.piece_bytes]
        self._arrays = [None] * len(pieces)
        self.pieces = pieces
        logger.debug(
            "host arena: %.2f GiB in %d pieces (%s)",
            total / (1 << 30),
            len(pieces),
            "pinned" if self.pinned else "pageable",
        )

    def view(self, index: int) -> torch.Tensor:
        """The byte view of chunk ``index``."""
        self._ensure()
        if not self.sizes[index]:
            return torch.empty(0, dtype=torch.uint8)
        piece, start = self.place[index]
        return self.pieces[piece][start : start + self.sizes[index]]

    def alias(
        self, index: int, offset: int, nbytes: int, dtype: torch.dtype, shape: torch.Size
    ) -> torch.Tensor:
        """A tensor over bytes ``[offset, offset + nbytes)`` of chunk ``index`` with a storage of
        its own: it shares the arena's memory, but ``torch.save``, safetensors and storage-identity
        checks (tied-weight detection) see only its bytes, where a view would carry the arena."""
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        self._ensure()
        piece, start = self.place[index]
        array = self._arrays[piece]
        if array is None:
            array = self._arrays[piece] = self.pieces[piece].numpy()
        count = nbytes // dtype.itemsize
        return torch.frombuffer(array, dtype=dtype, count=count, offset=start + offset).view(shape)

    def free(self) -> None:
        """Drop the allocation (views taken earlier keep their memory alive until dropped)."""
        self._arrays = []
        self.pieces = []
        self.place = []
        self.piece_bytes = []
        self.sizes = []
        self.total_bytes = 0


# cgroup v1 reports "no limit" as a huge page-aligned number instead of "max".
_CGROUP_V1_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class HostMemory:
    """Host RAM as the process may use it: the machine's, capped by the container's cgroup."""

    total_bytes: int
    available_bytes: int
    cgroup_limited: bool


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _meminfo(path: Path) -> dict[str, int]:
    values = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return values
    for line in lines:
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            values[key] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return values


def _cgroup_limit(root: Path) -> tuple[int, int] | None:
    """(limit, usage) in bytes of the container's memory cgroup (v2, else v1); None: no limit."""
    for limit_file, usage_file in (
        (root / "memory.max", root / "memory.current"),
        (root / "memory" / "memory.limit_in_bytes", root / "memory" / "memory.usage_in_bytes"),
    ):
        limit = _read_int(limit_file)
        if limit is not None and limit < _CGROUP_V1_UNLIMITED:
            return limit, _read_int(usage_file) or 0
    return None


def host_memory(
    meminfo: Path = Path("/proc/meminfo"), cgroup_root: Path = Path("/sys/fs/cgroup")
) -> HostMemory | None:
    """Total and available host RAM, the cgroup limit included; None where it cannot be read."""
    info = _meminfo(meminfo)
    if "MemTotal" not in info:
        return None
    total = info["MemTotal"]
    available = info.get("MemAvailable", info.get("MemFree", total))
    cgroup = _cgroup_limit(cgroup_root)
    if cgroup is not None and cgroup[0] < total:
        limit, usage = cgroup
        return HostMemory(limit, max(0, min(available, limit - usage)), cgroup_limited=True)
    return HostMemory(total, available, cgroup_limited=False)
