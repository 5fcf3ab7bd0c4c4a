"""Every LoRA layer type PEFT ships, under ``enable()``, attached and not, trains like plain PEFT:
Linear, DoRA, Embedding, Conv (a VLM's patch embedding), ``ParamWrapper`` (LoRA on MoE expert
parameters, ``target_parameters`` and ``all-linear`` on transformers' fused experts), and
bitsandbytes 4-bit and 8-bit bases."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import autooffload
from autooffload.bench.models import accepted_batch
from tests.peft.peft_runs import (
    Run,
    adamw,
    assert_same_training,
    batches,
    lora,
    runtime_for,
    tiny_llama,
    trained_weights,
)

STEPS = 4
CHUNK_SIZE = 20_000


def _tiny_moe() -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    return Qwen3MoeForCausalLM(config).train()


def _text_batches() -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": ids, "labels": ids} for ids in batches(STEPS)]


def _vlm() -> torch.nn.Module:
    from tests.peft.vlm_models import tiny_vlm

    return tiny_vlm("qwen2_vl")


def _vlm_batches() -> list[dict[str, torch.Tensor]]:
    from tests.peft.vlm_models import vlm_batch

    return [accepted_batch(_vlm(), vlm_batch("qwen2_vl", seed=s)) for s in range(STEPS)]


def _nf4_llama() -> torch.nn.Module:
    from tests.peft.qlora_runs import quantize_linears

    return quantize_linears(tiny_llama("resident"))


def _int8_llama() -> torch.nn.Module:
    from tests.peft.qlora_runs import int8_model

    return int8_model()


@dataclass(frozen=True)
class Case:
    build: Callable[[], torch.nn.Module]
    config: Callable[[], LoraConfig]
    data: Callable[[], list[dict[str, torch.Tensor]]]
    layer: str  # the PEFT layer class the case must create
    bnb: bool = False


EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _chunked_llama() -> torch.nn.Module:
    return tiny_llama("chunked")


CASES = {
    "linear": Case(_chunked_llama, lora, _text_batches, "Linear"),
    "dora": Case(_chunked_llama, lambda: lora(use_dora=True), _text_batches, "Linear"),
    "embedding": Case(
        _chunked_llama,
        lambda: lora(target_modules=["embed_tokens", "q_proj"]),
        _text_batches,
        "Embedding",
    ),
    "conv3d": Case(
        _vlm,
        lambda: lora(target_modules=["patch_embed.proj", "q_proj"]),
        _vlm_batches,
        "Conv3d",
    ),
    "moe-all-linear": Case(_tiny_moe, lora, _text_batches, "ParamWrapper"),
    "moe-target-parameters": Case(
        _tiny_moe,
        lambda: lora(target_modules=["q_proj"], target_parameters=EXPERTS),
        _text_batches,
        "ParamWrapper",
    ),
    "bnb-4bit": Case(_nf4_llama, lora, _text_batches, "Linear4bit", bnb=True),
    "bnb-8bit": Case(_int8_llama, lora, _text_batches, "Linear8bitLt", bnb=True),
}


def _run(case: Case, base: torch.nn.Module, mode: str) -> Run:
    """``plain``: no autooffload; ``enabled``: ``enable()`` with the model under the attach
    threshold (nothing attached); ``attached``: every chunk offloaded."""
    if mode != "plain":
        options = {"device": "cpu", "mask": False, "log": "warning", "chunk_size": CHUNK_SIZE}
        if mode == "attached":
            options.update(force_attach=True, n_persist=0)
        autooffload.enable(**options)
    torch.manual_seed(123)  # adapter init
    model = get_peft_model(copy.deepcopy(base), case.config())
    layers = {type(m).__name__ for m in model.modules()}
    assert case.layer in layers, sorted(layers)
    model.to("cpu")
    assert (runtime_for(model) is not None) == (mode == "attached")
    optimizer = adamw(model)
    losses = []
    for batch in case.data():
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    autooffload.disable()
    return Run(losses, trained_weights(model))


@pytest.mark.parametrize("mode", ["enabled", "attached"])
@pytest.mark.parametrize("name", list(CASES))
def test_every_lora_layer_type_trains_like_plain_peft(name: str, mode: str) -> None:
    case = CASES[name]
    if case.bnb:
        pytest.importorskip("bitsandbytes")
    base = case.build()
    expected = _run(case, base, "plain")
    assert expected.losses[-1] != expected.losses[0]
    assert_same_training(expected, _run(case, base, mode))
