"""Shared fixtures of the GPU tests."""

from __future__ import annotations

import gc

import pytest
import torch

import autooffload


@pytest.fixture
def clean_gpu():
    """After the test: autooffload disabled, and the memory it left cached given back."""
    yield
    autooffload.disable()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
