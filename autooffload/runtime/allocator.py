"""The CUDA caching allocator's expandable segments, switched on while a model is attached.

An attached step allocates and frees the same large blocks over and over (streamed chunks,
swapped activations, recompute), in an order the plan changes. The default allocator keeps each
``cudaMalloc`` as a fixed segment and splits it; under a tight cap the free space ends up in
slivers no request fits: measured on an H100, 0.2-0.9 GiB reserved but unusable at the OOMs of
QLoRA at 5 GiB, Qwen2-VL at 16 GiB and a 1.1B model at 1.6 GiB. Expandable segments map
physical pages into one growing virtual range per stream instead, so freed pages are reused
whatever the sizes (PyTorch's ``expandable_segments:True``).

The allocator reads the option at every allocation, so it can be switched at attach time, not
only through ``PYTORCH_CUDA_ALLOC_CONF`` before CUDA starts; the per-process memory fraction
still applies. ``AUTOOFFLOAD_EXPANDABLE_SEGMENTS``: auto (default) switches it on unless the
user's ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` sets ``expandable_segments`` either
way; on forces it; off leaves the allocator alone. The last detach restores the previous value.
"""

from __future__ import annotations

import os
import re

import torch

from autooffload.log import logger

_USER_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_OPTION = re.compile(r"expandable_segments\s*:\s*(\w+)", re.IGNORECASE)

# How many attached runtimes asked for the option; the value to restore when none is left.
_holders = 0
_restore: bool | None = None


def user_choice() -> bool | None:
    """``expandable_segments`` as the user's allocator env var sets it, or None if unset."""
    for name in _USER_ENV:
        match = _OPTION.search(os.environ.get(name, ""))
        if match is not None:
            return match.group(1).lower() in ("true", "1", "yes", "on")
    return None


def _set(value: bool) -> None:
    text = f"expandable_segments:{'True' if value else 'False'}"
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is not None:
        setter(text)
    else:  # torch < 2.9
        torch.cuda.memory._set_allocator_settings(text)


def active(setting: bool | None) -> bool:
    """Whether attached runs allocate from expandable segments under ``setting``
    (``settings.expandable_segments``; None is auto)."""
    if setting is not None:
        return setting if setting else bool(user_choice())
    choice = user_choice()
    return True if choice is None else choice


def acquire(setting: bool | None, device: torch.device) -> bool:
    """An attach on ``device``: switch expandable segments on where ``setting`` asks for it (see
    the module docstring). Returns whether this took a hold that ``release`` must give back."""
    global _holders, _restore
    if device.type != "cuda" or setting is False:
        return False
    if setting is None and user_choice() is not None:
        return False  # the user's allocator configuration stands
    if _holders == 0:
        _restore = bool(user_choice())
        if not _restore:
            _set(True)
            logger.debug("CUDA allocator: expandable_segments:True while a model is attached")
    _holders += 1
    return True


def release(held: bool) -> None:
    """A detach of a runtime whose ``acquire`` took a hold (``held``): the last one restores
    the allocator's previous value."""
    global _holders, _restore
    if not held or _holders == 0:
        return
    _holders -= 1
    if _holders == 0 and _restore is not None:
        _set(_restore)
        _restore = None
