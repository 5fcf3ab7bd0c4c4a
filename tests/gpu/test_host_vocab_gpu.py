"""On a GPU: LoRA with the frozen embedding's rows and head's tiles served from the host trains
like plain PEFT (bf16), and the profiling steps, which serve them, peak lower than with the
vocabulary gathered whole by most of the head's bytes."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import autooffload
from autooffload import runtime as rt
from autooffload.runtime import host_vocab

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("clean_gpu")]

VOCAB, HIDDEN, STEPS = 32_000, 512, 8
# bf16 both ways on the same device; the head's input gradient is summed over tiles in fp32
# (plain autograd: one matmul), ~1 bf16 ulp on the loss after a few steps.
LOSS_ATOL = 2e-2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=4 * HIDDEN,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))


def _train(model: torch.nn.Module, attach: bool) -> tuple[list[float], int]:
    if attach:
        autooffload.enable(force_attach=True, chunk_size=8 << 20, mask=False)
    try:
        model = model.to("cuda")
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        generator = torch.Generator().manual_seed(2)
        losses, peak = [], 0
        for step in range(STEPS):
            torch.cuda.reset_peak_memory_stats()
            ids = torch.randint(0, VOCAB, (2, 256), generator=generator).cuda()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if step < 2:  # the profiling steps
                peak = max(peak, torch.cuda.max_memory_allocated())
        return losses, peak
    finally:
        if attach:
            autooffload.disable()


def test_served_vocabulary_trains_like_plain_peft():
    model = _model()
    plain, _ = _train(copy.deepcopy(model), attach=False)
    attached, _ = _train(copy.deepcopy(model), attach=True)
    assert attached == pytest.approx(plain, abs=LOSS_ATOL)


def test_profiling_steps_peak_lower_with_the_vocabulary_served(monkeypatch):
    model = _model()
    _, served_peak = _train(copy.deepcopy(model), attach=True)
    monkeypatch.setattr(host_vocab, "_servable", lambda *args: "")
    _, gathered_peak = _train(copy.deepcopy(model), attach=True)
    head_bytes = VOCAB * HIDDEN * 2
    assert served_peak < gathered_peak - head_bytes // 2, (served_peak, gathered_peak)
    assert rt.registry.runtimes() == []
