"""Fixtures for PEFT tests: one intra-op thread, nothing left enabled after a test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import autooffload


@pytest.fixture(autouse=True)
def _one_thread_and_disable() -> Iterator[None]:
    """One intra-op thread (tiny kernels, stable on a shared box); nothing enabled after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    autooffload.disable()
