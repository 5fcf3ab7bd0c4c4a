"""Fault suite set-up: every test ends with autooffload disabled, torch on one thread."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import autooffload


@pytest.fixture(autouse=True)
def _disable_after() -> Iterator[None]:
    """Detach every model and remove every patch after each test, whatever it did."""
    yield
    autooffload.disable()


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread: tiny kernels are faster and deterministic that way."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
