"""Shared fixtures of the GPU tests."""

from __future__ import annotations

import gc

import pytest
import torch

import autooffload


@pytest.fixture(autouse=True)
def clean_gpu():
    """After every GPU test: autooffload disabled, and the memory it left cached given back. A
    model whose ``forward`` autooffload wrapped is freed by the cycle collector only, and under
    the allocator's expandable segments each of its live tensors keeps its pages reserved: a
    later test under a memory cap would find them counted against it."""
    yield
    autooffload.disable()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
