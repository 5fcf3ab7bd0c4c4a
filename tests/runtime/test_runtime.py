"""``Runtime.detach``: a detached model that the script drops is freed by reference counting."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch
from runtime_models import CHUNK_SIZE, batches, enable_cpu, tiny_llama

import autooffload
from autooffload import runtime as rt

# Profiling steps, then the searched plan's first step.
STEPS = 3


@pytest.fixture
def reference_counting_only() -> Iterator[None]:
    """Python's cycle collector off for the test: only reference counting frees objects."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    for ids in batches(STEPS):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _refs(model: torch.nn.Module, runtime: rt.Runtime) -> dict[str, weakref.ref]:
    return {
        "model": weakref.ref(model),
        "parameter": weakref.ref(next(model.parameters())),
        "runtime": weakref.ref(runtime),
        "chunk store": weakref.ref(runtime.manager),
    }


def test_a_detached_model_dropped_is_freed_at_once(reference_counting_only):
    """Its device and pinned host memory come back without a ``gc.collect()``."""
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    runtime = autooffload.attach(model, optimizer, device="cpu", chunk_size=CHUNK_SIZE)
    _train(model, optimizer)
    rt.detach(model)
    refs = _refs(model, runtime)
    del model, optimizer, runtime
    assert [name for name, ref in refs.items() if ref() is not None] == []


@pytest.mark.parametrize("fused_head", [None, True], ids=["default", "fused-head"])
def test_a_model_attached_by_enable_and_dropped_after_disable_is_freed_at_once(
    reference_counting_only, fused_head
):
    enable_cpu(fused_head=fused_head)
    model = tiny_llama().to("cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    runtime = rt.runtime_of(model)
    assert runtime is not None
    _train(model, optimizer)
    autooffload.disable()
    refs = _refs(model, runtime)
    del model, optimizer, runtime
    assert [name for name, ref in refs.items() if ref() is not None] == []
