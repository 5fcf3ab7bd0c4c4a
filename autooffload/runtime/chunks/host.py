"""Host store: one pinned CPU allocation holding every chunk's compute copy, freed on detach."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from autooffload.log import logger, warn_once


class HostArena:
    """A single host byte buffer carved into per-chunk views.

    One allocation instead of one per chunk: ``cudaHostAlloc`` is slow and fragments the
    pinned pool. If pinning fails (locked-memory limits, container caps) the arena falls back
    to pageable memory with one warning, since pageable copies are ~3x slower but correct.
    ``lazy``: allocate at the first view taken (the gradient staging of a model that may never
    train: a reference model loaded with its params requiring grad, used under no_grad).
    """

    def __init__(self, sizes: list[int], pin: bool, lazy: bool = False) -> None:
        self.offsets: list[int] = []
        total = 0
        for size in sizes:
            self.offsets.append(total)
            total += size
        self.total_bytes = total
        self.sizes = sizes
        self.pinned = False
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self._array: np.ndarray | None = None  # the buffer as numpy, for ``alias``
        self._pin = pin
        self._lock = threading.Lock()  # the first view may be taken on the optimizer's worker
        if total == 0:
            self.pinned = pin  # nothing to pin: report what was asked (a rank hosting no chunk)
            return
        if not lazy:
            self._allocate()

    @property
    def allocated(self) -> bool:
        """Whether the bytes exist (a lazy arena has none before its first view)."""
        return self.buffer.numel() > 0

    def _ensure(self) -> None:
        """Allocate a lazy arena's bytes, once, whichever thread asks first."""
        if self.buffer.numel() == 0 and self.total_bytes:
            with self._lock:
                if self.buffer.numel() == 0:
                    self._allocate()

    def _allocate(self) -> None:
        total, pin = self.total_bytes, self._pin
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

    def view(self, index: int) -> torch.Tensor:
        """The byte view of chunk ``index``."""
        self._ensure()
        start = self.offsets[index]
        return self.buffer[start : start + self.sizes[index]]

    def alias(
        self, index: int, offset: int, nbytes: int, dtype: torch.dtype, shape: torch.Size
    ) -> torch.Tensor:
        """A tensor over bytes ``[offset, offset + nbytes)`` of chunk ``index`` with a storage of
        its own: it shares the arena's memory, but ``torch.save``, safetensors and storage-identity
        checks (tied-weight detection) see only its bytes, where a view would carry the arena."""
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        self._ensure()
        if self._array is None:
            self._array = self.buffer.numpy()
        start = self.offsets[index] + offset
        count = nbytes // dtype.itemsize
        return torch.frombuffer(self._array, dtype=dtype, count=count, offset=start).view(shape)

    def free(self) -> None:
        """Drop the allocation (views taken earlier keep their memory alive until dropped)."""
        self._array = None
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.offsets = []
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
