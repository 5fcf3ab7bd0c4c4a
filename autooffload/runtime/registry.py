"""The registry of attached runtimes: which model each runtime manages, and the last plan made.

With the patch registry, the only global mutable state of the package; ``detach_all`` (and so
``autooffload.disable()``) empties it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from autooffload.plan.types import Plan
    from autooffload.runtime.runtime import Runtime

# Keyed by ``id(model)`` of the attached model, in attach order.
_attached: dict[int, Runtime] = {}
_last_plan: list[Plan] = []


def register(model: nn.Module, runtime: Runtime) -> None:
    """Record ``runtime`` as managing ``model`` and its plan as the last one."""
    _attached[id(model)] = runtime
    _last_plan[:] = [runtime.plan]


def unregister(model: nn.Module) -> Runtime | None:
    """Forget ``model``'s runtime and return it (None if ``model`` is not attached)."""
    return _attached.pop(id(model), None)


def forget_last_plan() -> None:
    """Forget the last plan (every model was detached)."""
    _last_plan.clear()


def attached(model: nn.Module) -> Runtime | None:
    """The runtime attached to exactly ``model`` (not to a module inside or around it)."""
    return _attached.get(id(model))


def runtimes() -> list[Runtime]:
    """Every attached runtime, in attach order."""
    return list(_attached.values())


def runtime_of(obj: nn.Module | torch.Tensor) -> Runtime | None:
    """The runtime managing a model, a module inside it, or one of its parameters, if any."""
    if isinstance(obj, nn.Module):
        runtime = _attached.get(id(obj))
        if runtime is not None:
            return runtime
        for candidate in _attached.values():
            if any(m is obj for m in candidate.model.modules()):
                return candidate
        return None
    for candidate in _attached.values():
        if candidate.owns(obj):
            return candidate
    return None


def runtimes_in(model: nn.Module) -> list[Runtime]:
    """Every runtime managing ``model``, a module inside it, or a model enclosing it; each once,
    in attach order (the same on every rank, for code issuing collectives per runtime)."""
    inside = {id(m) for m in model.modules()}
    return [
        r
        for r in _attached.values()
        if id(r.model) in inside or any(m is model for m in r.model.modules())
    ]


def set_last_plan(plan: Plan) -> None:
    """Record ``plan`` as the most recent one (a re-plan of an attached model)."""
    _last_plan[:] = [plan]


def last_plan() -> Plan | None:
    """The plan of the most recently attached (or re-planned) model."""
    return _last_plan[0] if _last_plan else None
