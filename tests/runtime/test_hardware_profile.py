"""The runtime's hardware profile under data parallelism: every rank measures, or none does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from autooffload.plan import hardware
from autooffload.runtime.control import planning


class FakeGroup:
    """Two ranks' answers to ``gather_object``; counts the barriers this rank joins."""

    def __init__(self, other: bool) -> None:
        self.other = other
        self.barriers = 0

    def gather_object(self, value: bool) -> list[bool]:
        return [value, self.other]

    def barrier(self) -> None:
        self.barriers += 1


def runtime_with(group: FakeGroup | None, cache_dir) -> SimpleNamespace:
    return SimpleNamespace(
        cpu_optim=SimpleNamespace(optimizer=None),
        settings=SimpleNamespace(reprofile=False, cache_dir=str(cache_dir)),
        manager=SimpleNamespace(host=SimpleNamespace(pinned=False), is_cuda=False),
        device=torch.device("cpu"),
        data_parallel=group,
    )


@pytest.fixture
def probes(monkeypatch):
    calls = []
    monkeypatch.setattr(
        hardware, "_host_bandwidths", lambda nbytes: calls.append(1) or (1e10, 2e10, 3e10)
    )
    monkeypatch.setattr(hardware, "optimizer_rate", lambda cls, device, dtype: (1e9, "AdamW"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("AUTOOFFLOAD_REPROFILE", raising=False)
    return calls


def test_a_rank_without_the_cache_makes_every_rank_measure_together(tmp_path, probes):
    planning.hardware_profile(runtime_with(FakeGroup(other=False), tmp_path))
    assert len(probes) == 1  # this rank had no cache: measured
    # This rank has the cache now, the other rank not: it measures again, with the others,
    # instead of reading its cache and leaving them waiting at the probes' barriers.
    group = FakeGroup(other=True)
    planning.hardware_profile(runtime_with(group, tmp_path))
    assert len(probes) == 2 and group.barriers >= 2
    # Every rank has it: none measures.
    group = FakeGroup(other=False)
    planning.hardware_profile(runtime_with(group, tmp_path))
    assert len(probes) == 2 and group.barriers == 0


def test_the_cache_of_ranks_sharing_a_host_is_not_one_rank_alone(tmp_path, probes, monkeypatch):
    planning.hardware_profile(runtime_with(FakeGroup(other=False), tmp_path))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    planning.hardware_profile(runtime_with(None, tmp_path))
    assert len(probes) == 2
