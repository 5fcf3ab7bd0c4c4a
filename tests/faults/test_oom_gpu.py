"""On a GPU: a real out-of-memory (a batch much longer than the profiled ones, under a
per-process memory cap) is retried once under a smaller plan and trains like uncapped plain
PyTorch; a batch that fits no plan raises ``OutOfMemoryRetryError`` and training goes on."""

from __future__ import annotations

import copy
import gc
import logging

import pytest
import torch
from _faults import Records, offloaded_chunks_on_host, worker_idle
from transformers import LlamaConfig, LlamaForCausalLM

import autooffload
from autooffload import runtime as rt
from autooffload.runtime.control.oom import REPROFILE_SOURCE, OutOfMemoryRetryError

pytestmark = pytest.mark.gpu

# A small vocabulary: the logits (kept whatever the plan) stay small next to the blocks.
VOCAB = 256
# Budget without AUTOOFFLOAD_BUDGET: the cap minus 1 GiB of safety margin, ~2 GiB.
CAP_BYTES = 3 << 30
# ~50 MB of fp32 weights; the blocks save ~20-32 KB per token each (measured on CPU), so a
# (8, 2048) batch keeps 4-6 GB of activations (OOM under the cap), ~1 GB when checkpointed.
SHORT, LONG, HUGE = (2, 64), (8, 2048), (96, 4096)
RTOL = ATOL = 1e-4


def model_for_oom() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=12,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).train()


def batch(shape: tuple[int, int], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, shape, generator=generator).cuda()


@pytest.fixture
def capped() -> None:
    """This process may use ``CAP_BYTES`` of the GPU, as if others held the rest.

    The cap counts reserved memory, so earlier tests' device tensors must be gone first: a model
    whose ``forward`` autooffload wrapped (an attached one, a detached one its runtime still
    references, a block under ``apply_policy``) is freed by the cycle collector only, and its
    tensors pin the 20 MiB expandable-segment pages they sit in (after the long-context test,
    ~8 GiB reserved under the 3 GiB cap, and every allocation of the test ran out of memory)."""
    total = torch.cuda.get_device_properties(0).total_memory
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    left = torch.cuda.memory_reserved()
    assert left < CAP_BYTES // 4, f"{left / 2**30:.2f} GiB still reserved from earlier tests"
    torch.cuda.set_per_process_memory_fraction(CAP_BYTES / total)
    yield
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()


def train(model: torch.nn.Module, data: list[torch.Tensor], steps: list) -> None:
    """Train on ``data``; ``steps`` gets one entry per optimizer step: the plan it ran under
    (None when not attached)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    runtime = rt.runtime_of(model)
    optimizer.register_step_post_hook(
        lambda *a: steps.append(runtime.plan if runtime is not None else None)
    )
    for ids in data:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_real_oom_from_a_longer_batch_is_retried_under_a_smaller_plan(capped):
    base = model_for_oom()
    data = [batch(SHORT, seed) for seed in range(4)] + [batch(LONG, 10), batch(SHORT, 11)]
    torch.cuda.set_per_process_memory_fraction(1.0)
    plain, plain_steps = copy.deepcopy(base).cuda(), []
    train(plain, data, plain_steps)
    expected = {k: v.detach().cpu() for k, v in plain.state_dict().items()}
    del plain
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(CAP_BYTES / total)

    # The budget is the cap (not the cap less the default 1 GiB kept free): the long batch's
    # plan needs ~2.6 GiB with every block but one checkpointed.
    autooffload.enable(force_attach=True, mask=False, oom_retry=True, budget=CAP_BYTES)
    model = copy.deepcopy(base).cuda()
    runtime = rt.runtime_of(model)
    records = Records()
    logging.getLogger("autooffload").addHandler(records)
    try:
        steps: list[int] = []
        train(model, data, steps)
    finally:
        logging.getLogger("autooffload").removeHandler(records)
    assert runtime.oom.retries == 1, "the long batch did not run out of memory: raise LONG"
    # 128x the profiled input: the retry is a profiling step of the long batch (every block
    # checkpointed), and the next step runs the plan searched from it.
    retried, after = steps[4], steps[5]
    assert retried.source == REPROFILE_SOURCE and retried.n_checkpoint > 0, retried.summary()
    assert after.source == "search", after.summary()
    assert len([line for line in records.lines if "out of memory" in line]) == 1
    assert len(steps) == len(plain_steps) == len(data)
    state = model.state_dict()
    for name, weight in expected.items():
        torch.testing.assert_close(state[name].cpu(), weight, rtol=RTOL, atol=ATOL, msg=name)


def test_real_oom_that_no_plan_fits_raises_a_clear_error_and_training_goes_on(capped):
    autooffload.enable(force_attach=True, mask=False, oom_retry=True)
    model = model_for_oom().cuda()
    runtime = rt.runtime_of(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for seed in range(3):
        ids = batch(SHORT, seed)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    ids = batch(HUGE, 3)
    with pytest.raises(OutOfMemoryRetryError) as raised:
        model(input_ids=ids, labels=ids).loss.backward()
    message = str(raised.value)
    assert "AUTOOFFLOAD_BUDGET" in message and "n_persist=" in message
    del raised, ids
    optimizer.zero_grad()
    assert offloaded_chunks_on_host(runtime) and worker_idle(runtime)
    ids = batch(SHORT, 4)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    # Offloaded params are readable inside ``gathered`` only: outside it their storage is
    # released, and a kernel reading them reads a null address (an illegal memory access).
    with autooffload.gathered(model):
        norms = torch.stack([p.detach().float().norm() for p in model.parameters()])
    assert torch.isfinite(norms).all()
