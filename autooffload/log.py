"""The package logger and the once-per-process warning helper."""

from __future__ import annotations

import logging
import warnings

logger = logging.getLogger("autooffload")

_warned: set[str] = set()


def configure(level: str) -> None:
    """Set the package logger level (debug, info, warning, error) and give it a handler."""
    logger.setLevel(getattr(logging, level.upper()))
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[autooffload] %(message)s"))
        logger.addHandler(handler)
    logger.propagate = False


def warn_once(key: str, message: str) -> None:
    """Emit ``message`` as a one-line warning the first time ``key`` is seen in this process."""
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, stacklevel=3)
    logger.warning(message)


def reset_warnings() -> None:
    """Forget which warnings were emitted (``disable()`` calls this)."""
    _warned.clear()
