"""Expandable segments while attached (runtime/allocator.py): who decides, when the allocator
is switched, and that the last detach restores it."""

from __future__ import annotations

import pytest
import torch

from autooffload.plan.profile_types import (
    DEFAULT_FRAGMENTATION,
    EXPANDABLE_FRAGMENTATION,
    ChunkProfile,
    ModelProfile,
    UnitProfile,
)
from autooffload.runtime import allocator

CUDA = torch.device("cuda", 0)


@pytest.fixture
def switched(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The values the allocator was set to, in order (nothing reaches torch)."""
    calls: list[bool] = []
    monkeypatch.setattr(allocator, "_set", calls.append)
    monkeypatch.setattr(allocator, "_holders", 0)
    monkeypatch.setattr(allocator, "_restore", None)
    for name in allocator._USER_ENV:
        monkeypatch.delenv(name, raising=False)
    return calls


def test_auto_switches_on_at_the_first_attach_and_back_at_the_last_detach(switched):
    first = allocator.acquire(None, CUDA)
    second = allocator.acquire(None, CUDA)
    assert first and second
    assert switched == [True]
    allocator.release(first)
    assert switched == [True], "restored while a runtime is still attached"
    allocator.release(second)
    assert switched == [True, False]
    assert allocator.active(None)


@pytest.mark.parametrize("value", ["True", "False"])
def test_auto_leaves_the_users_alloc_conf_alone(switched, monkeypatch, value):
    monkeypatch.setenv(
        "PYTORCH_CUDA_ALLOC_CONF", f"max_split_size_mb:128,expandable_segments:{value}"
    )
    assert not allocator.acquire(None, CUDA)
    assert switched == []
    assert allocator.active(None) is (value == "True")


def test_on_overrides_the_users_false_and_restores_it(switched, monkeypatch):
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    held = allocator.acquire(True, CUDA)
    assert held and switched == [True]
    allocator.release(held)
    assert switched == [True, False]


def test_off_and_cpu_devices_never_touch_the_allocator(switched, monkeypatch):
    assert not allocator.acquire(False, CUDA)
    assert not allocator.acquire(None, torch.device("cpu"))
    assert switched == []
    assert not allocator.active(False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert allocator.active(False), "off keeps the user's own expandable segments"


def test_release_without_a_hold_changes_nothing(switched):
    allocator.release(False)
    held = allocator.acquire(None, CUDA)
    allocator.release(False)
    assert switched == [True]
    allocator.release(held)
    assert switched == [True, False]


def test_the_fragmentation_prior_follows_the_allocator():
    unit = UnitProfile(1e-3, 2e-3, 1024)
    profile = ModelProfile(
        1 << 20, (ChunkProfile(1 << 20, 1 << 20, 1 << 19, (1,)),), (unit,), unit, unit
    )
    assert profile.fragmentation_factor == DEFAULT_FRAGMENTATION["bfloat16"]
    expandable = ModelProfile.from_dict({**profile.to_dict(), "expandable_segments": True})
    assert expandable.fragmentation_factor == EXPANDABLE_FRAGMENTATION
    assert expandable.with_fragmentation(1.2).fragmentation_factor == 1.2, "calibration wins"


def test_attach_on_the_cpu_simulation_holds_nothing(make_llama, offload_cpu, switched):
    model = make_llama(n_layers=2)
    offload_cpu()
    model.to("cpu")
    from autooffload import runtime as rt

    runtime = rt.runtime_of(model)
    assert runtime is not None and not runtime.expandable_segments
    assert not runtime.allocator_hold and switched == []
