"""The runtime: attach a model (chunked weight offload + CPU optimizer), detach it back."""

from __future__ import annotations

import torch
from torch import nn

from autooffload import patches
from autooffload.runtime import allocator, registry
from autooffload.runtime.attachable import check_attachable
from autooffload.runtime.registry import last_plan, runtime_of, runtimes, runtimes_in
from autooffload.runtime.runtime import Runtime
from autooffload.settings import Settings

__all__ = [
    "Runtime",
    "attach",
    "detach",
    "detach_all",
    "last_plan",
    "resolve_device",
    "runtime_of",
    "runtimes",
    "runtimes_in",
]


def resolve_device(settings: Settings, requested: torch.device | str | None = None) -> torch.device:
    """The compute device: the requested one, else ``settings.device``, else cuda if present."""
    if requested is not None:
        device = torch.device(requested)
    elif settings.device is not None:
        device = torch.device(settings.device)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def attach(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    settings: Settings | None = None,
    device: torch.device | str | None = None,
) -> Runtime:
    """Attach ``model``: its weights go to a host store, only persistent chunks to the device."""
    if settings is None:
        settings = Settings.from_env()
    existing = registry.attached(model)
    if existing is not None:
        if optimizer is not None:
            existing.bind_optimizer(optimizer)
        return existing
    check_attachable(model)
    resolved = resolve_device(settings, device)
    # Without enable(): the optimizer, clipping and LoRA wrappers this model needs, until the
    # last model detaches (they pass anything not attached straight through).
    patches.hold_for_attach(settings)
    # Before the runtime allocates its chunks and buffers on the device.
    held = allocator.acquire(settings.expandable_segments, resolved)
    try:
        runtime = Runtime(model, settings, resolved, allocator_hold=held)
    except BaseException:
        allocator.release(held)
        if not registry.runtimes():
            patches.release_for_attach()
        raise
    registry.register(model, runtime)
    if optimizer is not None:
        runtime.bind_optimizer(optimizer)
    return runtime


def detach(model: nn.Module, device: torch.device | str | None = None) -> nn.Module:
    """Detach one model; returns it as an ordinary module on ``device``."""
    runtime = registry.unregister(model)
    if runtime is None:
        return model if device is None else model.to(device)
    try:
        return runtime.detach(device)
    finally:
        if not registry.runtimes():
            patches.release_for_attach()


def detach_all() -> None:
    """Detach every attached model (``autooffload.disable()`` calls this)."""
    first: BaseException | None = None
    for runtime in registry.runtimes():
        registry.unregister(runtime.model)
        try:
            runtime.detach()
        except Exception as error:  # the others are detached all the same; the first is raised
            first = first or error
    registry.forget_last_plan()
    patches.release_for_attach()
    if first is not None:
        raise first
