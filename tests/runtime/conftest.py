"""Fixtures for runtime tests: tiny random-init Llamas and the CPU simulation of the runtime."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from runtime_models import batches, enable_cpu, n_chunks, tiny_llama
from transformers import LlamaForCausalLM

import autooffload


@pytest.fixture(autouse=True)
def _disable_after() -> Iterator[None]:
    """Detach every model and remove every patch after each test, whatever it did."""
    yield
    autooffload.disable()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Run torch on one intra-op thread: tiny kernels are faster and timing-stable that way on a
    shared CI box, and the CPU optimizer's worker thread then has a core of its own."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def make_llama() -> Callable[..., LlamaForCausalLM]:
    """Build a tiny Llama: ``make_llama(tied=..., n_layers=..., hidden=..., seed=...)``."""
    return tiny_llama


@pytest.fixture
def make_batches() -> Callable[..., list[torch.Tensor]]:
    """``make_batches(n, seed=1)``: the same token-id batches in every run."""
    return batches


@pytest.fixture
def offload_cpu() -> Callable[..., autooffload.Settings]:
    """``offload_cpu(**settings)``: enable the CPU simulation; a move to cpu then attaches."""
    return enable_cpu


@pytest.fixture
def chunk_count() -> Callable[..., int]:
    """``chunk_count(model, chunk_size=CHUNK_SIZE)``: chunks the model is laid into."""
    return n_chunks
