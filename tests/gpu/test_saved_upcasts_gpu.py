"""On a GPU: a bf16 Llama with fp32 LoRA adapters, attached, keeps less memory for the backward
with ``saved_upcasts`` (the bf16 input in place of each LoRA layer's fp32 copy) and trains to
the same weights bit for bit."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import autooffload
from autooffload import runtime as rt

pytestmark = pytest.mark.gpu

SEQ = 2048


def _run(saved_upcasts: bool, mode: str = "keep") -> tuple[int, dict[str, torch.Tensor]]:
    """Bytes allocated by the third forward (every block under ``mode``), and the adapters
    after three AdamW steps."""
    autooffload.enable(
        saved_upcasts=saved_upcasts,
        force_attach=True,
        activation_mode=mode,
        n_persist=0,
        mask=False,
        log="warning",
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        attn_implementation="sdpa",
    )
    base = LlamaForCausalLM(config).to(torch.bfloat16)
    torch.manual_seed(1)
    model = get_peft_model(base, LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0))
    model.to("cuda")
    assert rt.runtime_of(model) or rt.runtime_of(model.get_base_model())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(2)).cuda()
    saved = 0
    for index in range(3):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = model(input_ids=ids, labels=ids).loss
        if index == 2:  # the searched plan's step
            saved = torch.cuda.memory_allocated() - before
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    weights = {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
    autooffload.disable()
    return saved, weights


def test_lora_upcasts_saved_as_their_bf16_input_on_the_gpu(clean_gpu) -> None:
    shared, weights = _run(True)
    copies, plain = _run(False)
    for name, value in weights.items():
        assert torch.equal(value, plain[name]), name
    # Per layer and token, fp32 copies of the inputs of q, k, v, o, gate, up (6 x 512) and
    # down (1536): 18 KiB; the bf16 inputs saved instead (q/k/v's, o's, gate/up's, down's):
    # 3 x 512 + 1536 elements, 6 KiB. Two layers.
    assert copies - shared >= 0.9 * 2 * SEQ * (4 * (6 * 512 + 1536) - 2 * (3 * 512 + 1536))


def test_checkpointed_blocks_hold_no_lora_input_past_the_forward_on_the_gpu(clean_gpu) -> None:
    """Checkpointed, a block saves nothing of its LoRA layers: what the forward leaves
    allocated is the same with ``saved_upcasts`` as without (a source held past its layer's
    forward would add a hidden state per LoRA input, 3 a layer), and training the same."""
    shared, weights = _run(True, "checkpoint")
    plain, plain_weights = _run(False, "checkpoint")
    for name, value in weights.items():
        assert torch.equal(value, plain_weights[name]), name
    hidden_state = SEQ * 512 * 2
    assert abs(shared - plain) < hidden_state, (shared, plain)
