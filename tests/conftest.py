"""Shared test set-up: skip GPU tests without GPUs, keep every test's env and patches isolated."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

# ``slow_workers``: every task submitted to an autooffload executor (the CPU optimizer's worker,
# the GPU update path's thread) first sleeps this many seconds, drawn uniformly with a fixed
# seed. Correct code trains alike whatever the delays; main-thread code that reads state a
# task sets without waiting for it fails under them.
SLOW_WORKER_DELAY_S = (0.002, 0.012)
SLOW_WORKER_SEED = 0
# Thread name prefixes of the executors ``--slow-workers`` slows, by option value.
_SLOWED = {
    "all": ("autooffload-cpu-optim", "autooffload-gpu-update"),
    "cpu": ("autooffload-cpu-optim",),
    "gpu": ("autooffload-gpu-update",),
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow-workers",
        nargs="?",
        const="all",
        default=None,
        choices=sorted(_SLOWED),
        help="delay every task of autooffload's executors by a few ms (all, cpu or gpu)",
    )


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


class SlowWorkers:
    """The delays ``slow_workers`` adds: ``tasks`` counts the delayed tasks."""

    def __init__(self, prefixes: tuple[str, ...], delay_s: tuple[float, float], seed: int):
        self.prefixes = prefixes
        self.delay_s = delay_s
        self.tasks = 0
        self._random = random.Random(seed)
        self._lock = threading.Lock()

    def delay(self, executor: ThreadPoolExecutor) -> float | None:
        """The sleep before a task submitted to ``executor`` (None: not one of autooffload's)."""
        if not getattr(executor, "_thread_name_prefix", "").startswith(self.prefixes):
            return None
        with self._lock:
            self.tasks += 1
            return self._random.uniform(*self.delay_s)


def _slow(monkeypatch: pytest.MonkeyPatch, prefixes: tuple[str, ...]) -> SlowWorkers:
    slow = SlowWorkers(prefixes, SLOW_WORKER_DELAY_S, SLOW_WORKER_SEED)
    submit = ThreadPoolExecutor.submit

    def delayed_submit(self, fn, /, *args, **kwargs):
        delay = slow.delay(self)
        if delay is None:
            return submit(self, fn, *args, **kwargs)

        def late(*args, **kwargs):
            time.sleep(delay)
            return fn(*args, **kwargs)

        return submit(self, late, *args, **kwargs)

    monkeypatch.setattr(ThreadPoolExecutor, "submit", delayed_submit)
    return slow


@pytest.fixture
def slow_workers(monkeypatch: pytest.MonkeyPatch) -> Iterator[SlowWorkers]:
    """Every task of autooffload's executors (the CPU worker, the GPU update thread) sleeps
    2-12 ms (seeded) before it runs: a main-thread read of state a task sets, without waiting
    for that task, then sees it unset. Results of correct code do not change."""
    yield _slow(monkeypatch, _SLOWED["all"])


@pytest.fixture(autouse=True)
def _slow_workers_option(request: pytest.FixtureRequest) -> None:
    """``--slow-workers[=all|cpu|gpu]``: ``slow_workers`` for every test (or one executor)."""
    which = request.config.getoption("--slow-workers")
    if which is not None and "slow_workers" not in request.fixturenames:
        _slow(request.getfixturevalue("monkeypatch"), _SLOWED[which])


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
