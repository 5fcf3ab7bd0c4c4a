"""Shared test set-up: skip GPU tests without GPUs, keep every test's env and patches isolated."""

from __future__ import annotations

import os

import pytest


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu`` tests without CUDA and ``multigpu`` tests with fewer than two GPUs."""
    needs_gpu = [item for item in items if "gpu" in item.keywords or "multigpu" in item.keywords]
    if not needs_gpu:
        return
    n_gpus = _cuda_device_count()
    for item in needs_gpu:
        if "multigpu" in item.keywords and n_gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs >= 2 CUDA devices, found {n_gpus}"))
        elif "gpu" in item.keywords and n_gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.fixture(autouse=True)
def _isolated_autooffload(monkeypatch: pytest.MonkeyPatch):
    """Run each test without inherited ``AUTOOFFLOAD*`` env vars and leave nothing enabled."""
    for key in list(os.environ):
        if key == "AUTOOFFLOAD" or key.startswith("AUTOOFFLOAD_"):
            monkeypatch.delenv(key)
    yield
    import autooffload

    autooffload.disable()


@pytest.fixture
def gpu_updates(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Chunk indices the GPU path updated, one entry per chunk update."""
    seen: list[int] = []
    from autooffload.runtime.update.gpu_update import GpuUpdater

    issue = GpuUpdater._issue

    def counted(self, task, start):
        seen.append(task.chunk.index)
        return issue(self, task, start)

    monkeypatch.setattr(GpuUpdater, "_issue", counted)
    return seen


@pytest.fixture
def resident_updates(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Chunk indices the GPU updated in the backward (``update_resident``), one per update."""
    seen: list[int] = []
    from autooffload.runtime.update.gpu_update import GpuUpdater

    update = GpuUpdater.update_resident

    def counted(self, chunk, *args):
        seen.append(chunk.index)
        return update(self, chunk, *args)

    monkeypatch.setattr(GpuUpdater, "update_resident", counted)
    return seen
