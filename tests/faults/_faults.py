"""Helpers of the fault suite: a tiny Llama, fixed batches, the CPU simulation, and checks of
the runtime's state after a fault."""

from __future__ import annotations

import logging
import threading

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import autooffload
from autooffload.runtime.manager import Residency
from autooffload.runtime.runtime import Runtime

VOCAB = 128
SEQ = 16
BATCH = 2
# A decoder layer of the tiny Llama (~37 KB) spans two chunks and the embedding one.
CHUNK_SIZE = 20_000
# Both runs do the same fp32 math with the same fused optimizer kernels; see
# tests/runtime/test_offload_equivalence.py for why 1e-5 and what a real bug moves (~1e-2).
RTOL = 1e-5
ATOL = 1e-5


def tiny_llama(*, tied: bool = True, n_layers: int = 3, seed: int = 0) -> LlamaForCausalLM:
    """A random-init Llama small enough for CPU tests (hidden 32, vocab 128)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config).train()


def batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    """``n`` batches of token ids, the same for every run with the same seed."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator) for _ in range(n)]


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
