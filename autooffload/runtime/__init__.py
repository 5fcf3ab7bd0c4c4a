"""The runtime: attach a model (chunked weight offload + CPU optimizer), detach it back."""

from __future__ import annotations

import torch
from torch import nn

from autooffload import patches
from autooffload.plan.types import Plan
from autooffload.runtime import allocator
from autooffload.runtime.attachable import check_attachable
from autooffload.runtime.runtime import Runtime
from autooffload.settings import Settings

# The active-runtimes registry: the only global state besides the patch registry.
_runtimes: dict[int, Runtime] = {}
_last_plan: list[Plan] = []


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
    existing = _runtimes.get(id(model))
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
        runtime = Runtime(model, settings, resolved)
    except BaseException:
        allocator.release(held)
        if not _runtimes:
            patches.release_for_attach()
        raise
    runtime.allocator_hold = held
    _runtimes[id(model)] = runtime
    _last_plan[:] = [runtime.plan]
    if optimizer is not None:
        runtime.bind_optimizer(optimizer)
    return runtime


def runtime_of(obj: nn.Module | torch.Tensor) -> Runtime | None:
    """The runtime managing a model (or one of its parameters), if any."""
    if isinstance(obj, nn.Module):
        runtime = _runtimes.get(id(obj))
        if runtime is not None:
            return runtime
        for candidate in _runtimes.values():
            if any(m is obj for m in candidate.model.modules()):
                return candidate
        return None
    for candidate in _runtimes.values():
        if candidate.owns(obj):
            return candidate
    return None


def runtimes() -> list[Runtime]:
    return list(_runtimes.values())


def runtimes_in(model: nn.Module) -> list[Runtime]:
    """Every runtime managing ``model``, a module inside it, or a model enclosing it; each once,
    in attach order (the same on every rank, for code issuing collectives per runtime)."""
    inside = {id(m) for m in model.modules()}
    return [
        r
        for r in _runtimes.values()
        if id(r.model) in inside or any(m is model for m in r.model.modules())
    ]


def detach(model: nn.Module, device: torch.device | str | None = None) -> nn.Module:
    """Detach one model; returns it as an ordinary module on ``device``."""
    runtime = _runtimes.pop(id(model), None)
    if runtime is None:
        return model if device is None else model.to(device)
    try:
        return runtime.detach(device)
    finally:
        if not _runtimes:
            patches.release_for_attach()


def detach_all() -> None:
    """Detach every attached model (``autooffload.disable()`` calls this)."""
    first: BaseException | None = None
    for key in list(_runtimes):
        try:
            _runtimes.pop(key).detach()
        except Exception as error:  # the others are detached all the same; the first is raised
            first = first or error
    _last_plan.clear()
    patches.release_for_attach()
    if first is not None:
        raise first


def last_plan() -> Plan | None:
    """The plan of the most recently attached (or re-planned) model."""
    return _last_plan[0] if _last_plan else None
