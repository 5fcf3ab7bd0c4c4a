"""NCCL's tensor contract on a gloo group, for data-parallel ranks that share one GPU.

NCCL refuses two ranks on one device, so on a one-GPU machine the data-parallel worker runs
over gloo; left alone, the runtime then takes its gloo branches (collectives on host tensors,
SUM after a division) and never its NCCL ones. ``install`` makes every ``DataParallel`` take
the NCCL branches (``nccl = True``: collectives on device tensors, ``ReduceOp.AVG``) and wraps
the ``torch.distributed`` collectives the runtime calls so that, on the main group, each one
first checks its tensors as NCCL would -- CUDA tensors on this rank's device, contiguous, an
op NCCL has -- and then runs on host copies over gloo (AVG as a sum then a division), in the
order of the calling stream, as NCCL orders a collective after the work queued before it.

An asynchronous collective's result reaches its tensors only at ``wait()``, so a read of it
before the wait sees the old values (under NCCL, a race). What it cannot show: NCCL reading
its input late (here the input is copied when the call is made, so a write to it before the
wait goes unseen), NCCL's timing, and NCCL-only failures (topology, transport). Groups other
than the main one (the runtime's gloo lockstep group) pass through untouched.
"""

from __future__ import annotations

import functools
import inspect
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# Collective -> (the arguments holding its tensors, who ends up with the result).
WRAPPED = {
    "broadcast": (("tensor",), "all"),
    "all_reduce": (("tensor",), "all"),
    "reduce": (("tensor",), "dst"),
    "send": (("tensor",), "none"),
    "recv": (("tensor",), "all"),
    "all_gather": (("tensor_list", "tensor"), "all"),
}
NCCL_OPS = ("SUM", "AVG", "MAX", "MIN", "PRODUCT")

calls: Counter[str] = Counter()


class _Pending:
    """The work handle of an asynchronous collective, done over gloo when it was called but
    written to its device tensors only at ``wait()`` (or a completed ``is_completed()``): under
    NCCL the result is ordered for the current stream only by ``wait()``, so a read before it
    races. Here it reads the old values, which the tests see."""

    def __init__(self, deliver: Callable[[], None]) -> None:
        self._deliver: Callable[[], None] | None = deliver

    def wait(self, timeout: Any = None) -> bool:
        if self._deliver is not None:
            self._deliver()
            self._deliver = None
        return True

    def is_completed(self) -> bool:
        return self.wait()


def _tensors(value: Any) -> list[torch.Tensor]:
    return list(value) if isinstance(value, list | tuple) else [value]


def _check(name: str, tensors: list[torch.Tensor], op: Any) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    for tensor in tensors:
        if tensor.device != device:
            raise RuntimeError(
                f"NCCL emulation: dist.{name} got a tensor on {tensor.device};"
                f" NCCL takes tensors on this rank's device ({device}) only"
            )
        if not tensor.is_contiguous():
            raise RuntimeError(f"NCCL emulation: dist.{name} got a non-contiguous tensor")
    if op is not None and not any(op == getattr(dist.ReduceOp, o) for o in NCCL_OPS):
        raise RuntimeError(f"NCCL emulation: dist.{name} got op {op}, which NCCL lacks")


def _wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)
    names, receives = WRAPPED[name]

    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        group = bound.arguments.get("group")
        if group is not None and group is not dist.group.WORLD:
            return original(*args, **kwargs)
        arguments = bound.arguments
        op = arguments.get("op")
        devices = [t for n in names for t in _tensors(arguments[n])]
        _check(name, devices, op)
        calls[name] += 1
        # A blocking copy on the current stream: after the work queued on it, as NCCL.
        hosts = {n: [t.cpu() for t in _tensors(arguments[n])] for n in names}
        staged = dict(arguments, async_op=False) if "async_op" in arguments else dict(arguments)
        for n in names:
            staged[n] = hosts[n] if isinstance(arguments[n], list | tuple) else hosts[n][0]
        average = op is not None and op == dist.ReduceOp.AVG
        if average:
            staged["op"] = dist.ReduceOp.SUM
        result = original(**staged)

        def deliver() -> None:
            if receives == "all" or (receives == "dst" and dist.get_rank() == arguments["dst"]):
                for n in names:
                    for device_tensor, host in zip(_tensors(arguments[n]), hosts[n], strict=True):
                        if average:
                            host.div_(dist.get_world_size())
                        device_tensor.copy_(host)

        if arguments.get("async_op"):
            return _Pending(deliver)
        deliver()
        return result

    return collective


def rejects_host_tensors() -> bool:
    """Whether a main-group collective on a host tensor fails here, as under NCCL (every rank
    raises before any communication, so the ranks stay paired)."""
    try:
        dist.broadcast(torch.zeros(1), src=0)
    except RuntimeError as error:
        return "NCCL emulation" in str(error)
    return False


def install() -> None:
    """Make this process's data-parallel runtime take and check the NCCL branches."""
    from autooffload.runtime.parallel.distributed import DataParallel

    for name in WRAPPED:
        setattr(dist, name, _wrap(name, getattr(dist, name)))
    init = DataParallel.__init__

    @functools.wraps(init)
    def nccl_init(self: DataParallel, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.nccl = True

    DataParallel.__init__ = nccl_init  # type: ignore[method-assign]
