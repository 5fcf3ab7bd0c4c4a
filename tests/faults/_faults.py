"""Helpers of the fault suite: a tiny Llama, fixed batches, the CPU simulation, and checks of
the runtime's state after a fault."""

from __future__ import annotations

import logging
import threading

import torch

# The tiny Llama, its fixed batches and the chunk size are the runtime tests' own (re-exported
# for the fault tests).
from runtime.runtime_models import BATCH as BATCH
from runtime.runtime_models import CHUNK_SIZE
from runtime.runtime_models import VOCAB as VOCAB
from runtime.runtime_models import batches as batches
from runtime.runtime_models import tiny_llama as tiny_llama

import autooffload
from autooffload.runtime.chunks.store import Residency
from autooffload.runtime.runtime import Runtime

# Both runs do the same fp32 math with the same fused optimizer kernels; see
# tests/runtime/test_offload_equivalence.py for why 1e-5 and what a real bug moves (~1e-2).
RTOL = 1e-5
ATOL = 1e-5


def enable_cpu(**overrides) -> autooffload.Settings:
    """The CPU simulation: a move to ``cpu`` of any trained model attaches it."""
    settings = {
        "device": "cpu",
        "force_attach": True,
        "chunk_size": CHUNK_SIZE,
        "mask": False,
        "log": "warning",
        **overrides,
    }
    return autooffload.enable(**settings)


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_weights(expected: dict, actual: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, weight in expected.items():
        torch.testing.assert_close(actual[name], weight, rtol=RTOL, atol=ATOL, msg=name)


def offloaded_chunks_on_host(runtime: Runtime) -> bool:
    """Every non-persistent chunk is released, with no copy pending."""
    manager = runtime.manager
    return all(
        state == Residency.HOST and manager.ready_events[index] is None
        for index, state in enumerate(manager.state)
        if index not in manager.persistent
    )


def no_offloaded_grad_on_device(runtime: Runtime) -> bool:
    return all(
        slot.param.grad is None
        for chunk in runtime.layout.chunks
        if chunk.index not in runtime.manager.persistent
        for slot in chunk.slots
    )


def worker_idle(runtime: Runtime) -> bool:
    """The CPU optimizer's worker thread takes new work at once and has nothing else queued."""
    worker = runtime.cpu_optim.worker
    answered = worker.submit(lambda: True).result(timeout=5)
    return answered and worker._work_queue.empty() and any(t.is_alive() for t in worker._threads)


def autooffload_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("autooffload")]


class Records(logging.Handler):
    """The package logger's messages (it does not propagate to the root logger)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class Boom(RuntimeError):
    """The user's code failing (a bad batch, an assertion in a custom layer)."""


class _RaiseInBackward(torch.autograd.Function):
    """Identity in forward; raises ``fault.kind`` in backward (a custom op's backward failing)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fault: Fault) -> torch.Tensor:
        ctx.fault = fault
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        fault = ctx.fault
        if fault.armed:
            fault.armed = False
            raise fault.kind("injected in backward")
        return grad, None


class Fault:
    """Raises ``kind`` once, in the forward or the backward of a module in the middle of the
    model, the same way in the plain and the attached run."""

    def __init__(self, module: torch.nn.Module, where: str, kind: type[BaseException]) -> None:
        self.where, self.kind, self.armed = where, kind, False
        module.register_forward_hook(self._hook)

    def _hook(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        if self.armed and self.where == "forward":
            self.armed = False
            raise self.kind("injected in forward")
        if self.armed and self.where == "backward" and torch.is_grad_enabled():
            return _RaiseInBackward.apply(output, self)
        return output
