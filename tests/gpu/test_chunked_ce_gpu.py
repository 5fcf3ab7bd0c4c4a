"""On a GPU: the chunked causal-LM loss cuts the loss's peak memory at a 128256-token vocabulary."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import autooffload

pytestmark = pytest.mark.gpu

VOCAB, SEQ = 128256, 4096


def small_hidden_big_vocab() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).to("cuda", torch.bfloat16).train()


def step_peak(model: LlamaForCausalLM) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Peak bytes above the resting model during one step, the loss and lm_head's gradient."""
    model.zero_grad(set_to_none=True)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1)).cuda()
    torch.cuda.synchronize()
    resting = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - resting
    return peak, out.loss.detach().float(), model.lm_head.weight.grad.float()


def test_chunked_loss_peak_memory_drops_and_loss_matches():
    model = small_hidden_big_vocab()
    step_peak(model)  # warm-up: cuBLAS workspaces and the like are not the loss's
    hf_peak, hf_loss, hf_grad = step_peak(model)
    autooffload.enable()
    peak, loss, grad = step_peak(model)
    logits_bytes = SEQ * VOCAB * 2
    # transformers: bf16 logits + fp32 copy + fp32 log-softmax + fp32 grads in backward (~5x);
    # chunked: bf16 logits + their bf16 grad + chunks (~2x).
    assert hf_peak > 3 * logits_bytes, hf_peak / logits_bytes
    assert peak < 0.5 * hf_peak, (peak / 2**30, hf_peak / 2**30)
    torch.testing.assert_close(loss, hf_loss, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grad, hf_grad, rtol=2e-2, atol=1e-4)
