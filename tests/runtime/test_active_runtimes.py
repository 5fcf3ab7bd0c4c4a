"""The active-runtimes registry: which runtimes a model, a part of it or a wrapper reaches."""

from __future__ import annotations

import torch
from runtime_models import enable_cpu, tiny_llama

import autooffload
from autooffload import runtime as rt
from autooffload.runtime import registry


def test_runtimes_in_finds_each_runtime_once_from_the_model_a_part_or_a_wrapper():
    enable_cpu()
    try:
        first, second = tiny_llama().to("cpu"), tiny_llama(seed=1).to("cpu")
        wrapper = torch.nn.ModuleDict({"a": first, "b": second})
        runtime = rt.runtime_of(first)
        assert runtime is not None
        # Once, although every submodule of the model maps to it (a DDP wrap broadcasts the
        # whole model per runtime found).
        assert rt.runtimes_in(first) == [runtime]
        assert rt.runtimes_in(first.model.layers[0]) == [runtime]
        assert rt.runtimes_in(wrapper) == [runtime, rt.runtime_of(second)]
        assert rt.runtimes_in(torch.nn.Linear(2, 2)) == []
    finally:
        autooffload.disable()


def test_disable_empties_the_registry_and_forgets_the_last_plan():
    enable_cpu()
    try:
        model = tiny_llama().to("cpu")
        runtime = registry.attached(model)
        assert runtime is not None and registry.runtimes() == [runtime]
        assert registry.attached(model.model) is None  # a part is reached by runtime_of only
        assert autooffload.last_plan() is runtime.plan
    finally:
        autooffload.disable()
    assert registry.runtimes() == [] and autooffload.last_plan() is None
    assert registry.runtime_of(model) is None
