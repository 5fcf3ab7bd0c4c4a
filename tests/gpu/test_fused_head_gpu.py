"""On a GPU: the LM head fused with the loss keeps a long sequence's logits from ever being made,
and trains as the model's own forward does."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import autooffload
from autooffload import runtime as rt

pytestmark = pytest.mark.gpu

VOCAB, SEQ = 128256, 16384


def small_hidden_big_vocab() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).to(torch.bfloat16).train()


def train_steps(model: torch.nn.Module, steps: int = 3) -> tuple[list[float], int]:
    """Losses of ``steps`` AdamW steps on fixed batches, and the largest step peak above the
    resting allocation (the last steps: the planned ones when attached)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(1)
    losses, peaks = [], []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (1, SEQ), generator=generator).cuda()
        torch.cuda.synchronize()
        resting = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - resting)
        losses.append(loss.item())
    return losses, max(peaks[-2:])


def test_fused_head_trains_like_plain_without_the_logits():
    base = small_hidden_big_vocab()
    plain_losses, plain_peak = train_steps(copy.deepcopy(base).cuda())
    # Under the 1 GiB attach threshold: attached only when asked.
    autooffload.enable(fused_head=True, n_persist=0, force_attach=True)
    model = copy.deepcopy(base).to("cuda")
    runtime = rt.runtime_of(model)
    assert runtime is not None
    losses, peak = train_steps(model)
    fused_steps = runtime.fused_head.fused_steps
    autooffload.disable()
    logits_bytes = SEQ * VOCAB * 2
    assert fused_steps == 3
    # Plain: bf16 logits and their gradient at least; fused: neither.
    assert plain_peak > 2 * logits_bytes, plain_peak / logits_bytes
    assert peak < 0.5 * logits_bytes, (peak / 2**30, logits_bytes / 2**30)
    # The first loss is the same forward; later ones follow fp32-master updates (the CPU
    # optimizer) where plain AdamW updates the bf16 weights.
    assert losses[0] == pytest.approx(plain_losses[0], rel=1e-3)
    assert losses == pytest.approx(plain_losses, rel=1e-2)
