"""Imports of optional dependencies: bitsandbytes (the ``qlora`` extra), quietly, or an error
that names the extra to install."""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

from autooffload.errors import MissingExtraError

# bitsandbytes' CPU backend logs this warning at import on CPUs with AVX512-BF16 when the
# optional ``kernels`` package is absent; its fallback kernel works, so the line is noise.
_BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"
_BNB_CPU_NOISE = "Failed to load CPU gemm_4bit_forward"


def _drop_kernels_notice(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_BNB_CPU_NOISE)


def import_bitsandbytes() -> ModuleType:
    """``bitsandbytes``, imported without its CPU-kernel notice; ``MissingExtraError`` if it is
    not installed."""
    cpu_logger = logging.getLogger(_BNB_CPU_LOGGER)
    cpu_logger.addFilter(_drop_kernels_notice)
    try:
        return importlib.import_module("bitsandbytes")
    except ImportError as error:
        raise MissingExtraError(
            "QLoRA (4-bit or 8-bit bitsandbytes weights) needs bitsandbytes, which is not"
            f' installed ({error}); install it with: pip install "autooffload[qlora]"'
        ) from error
    finally:
        cpu_logger.removeFilter(_drop_kernels_notice)
