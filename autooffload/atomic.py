"""Write a file atomically: a crash or an exception mid-write leaves the old file intact."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "w") -> Iterator[IO]:
    """Open a temporary file next to ``path`` for writing (``mode`` "w" or "wb"); when the block
    ends without an exception it is flushed to disk and renamed over ``path`` (``os.replace`` is
    atomic on one filesystem), otherwise removed. Parent directories are created."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write mode must be 'w' or 'wb', not {mode!r}")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, mode) as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """``Path(path).write_text(text)``, atomically."""
    with atomic_write(path) as file:
        file.write(text)
