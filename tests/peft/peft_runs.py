"""Helpers for PEFT tests: tiny fp32 Llamas, LoRA configs, plain-vs-attached training runs."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import autooffload
from autooffload import runtime as rt

VOCAB = 128
SEQ = 16
BATCH = 2
STEPS = 20
# Model sizes by where the LoRA adapters end up. "resident": hidden 256, r=8 adapters are ~5% of
# the bytes (< RESIDENT_TRAINABLE_SHARE), so they stay on the device outside chunks and only
# the frozen base streams. "chunked": hidden 32, the same adapters are ~25% of the bytes and
# follow the full fine-tuning path (chunks, CPU optimizer) with the base.
HIDDEN = {"resident": 256, "chunked": 32}
# Bytes per chunk: a decoder layer spans 2-3 chunks at either size.
CHUNK_SIZE = {"resident": 1_000_000, "chunked": 20_000}
# Both runs do the same fp32 math with the same kernels: the user's optimizer updates resident
# adapters exactly as in plain PEFT, and a chunked path uses the fused CPU AdamW the reference
# uses too. Measured: bit-identical. The bound allows for a different kernel or summation
# order (~1e-7 relative per op, <= ~3e-6 after 20 AdamW steps as in tests/runtime); a real bug
# (a stale chunk, a lost merge, a missed update) moves weights by ~lr = 1e-2.
RTOL = 1e-5
ATOL = 1e-5


def tiny_llama(size: str = "resident", *, tied: bool = False, seed: int = 0) -> LlamaForCausalLM:
    """A random-init fp32 Llama with 3 layers, vocab 128, hidden per ``HIDDEN[size]``."""
    torch.manual_seed(seed)
    hidden = HIDDEN[size]
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config).train()


def batches(n: int = STEPS, seed: int = 1) -> list[torch.Tensor]:
    """``n`` batches of token ids, the same for every run with the same seed."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator) for _ in range(n)]


def lora(**overrides) -> LoraConfig:
    """LoRA r=8 on every linear layer (lm_head excluded, as ``all-linear`` does)."""
    options = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear"}
    return LoraConfig(**{**options, **overrides})


def enable_cpu(size: str = "resident", **overrides) -> autooffload.Settings:
    """CPU simulation with every chunk offloaded: a move to ``cpu`` of a trained model attaches."""
    settings = {
        "device": "cpu",
        "force_attach": True,
        "chunk_size": CHUNK_SIZE[size],
        "n_persist": 0,
        "mask": False,
        "log": "warning",
        **overrides,
    }
    return autooffload.enable(**settings)


def wrap(
    base: torch.nn.Module,
    config: LoraConfig,
    order: str,
    size: str,
    before_move: Callable[[PeftModel], object] | None = None,
) -> PeftModel:
    """Make ``base`` a PeftModel the way a script does, in ``order``:

    ``plain``: no autooffload. ``peft_then_move``: ``get_peft_model`` then ``.to(device)`` (the
    PeftModel attaches). ``move_then_peft``: ``.to(device)`` of the base (it attaches), then
    ``get_peft_model`` around the attached model, then ``.to(device)`` of the wrapper.
    ``before_move`` runs on the PeftModel right before that last move.
    """
    if order != "plain":
        enable_cpu(size)
    if order == "move_then_peft":
        base.to("cpu")
        assert rt.runtime_of(base) is not None, "the move did not attach the base"
    torch.manual_seed(123)  # adapter init
    model = get_peft_model(base, config)
    if before_move is not None:
        before_move(model)
    if order != "plain":
        model.to("cpu")
        assert runtime_for(model) is not None, "the model is not attached"
    return model


def runtime_for(model: PeftModel) -> rt.Runtime | None:
    """The runtime of the PeftModel itself, or of the base model it wraps."""
    return rt.runtime_of(model) or rt.runtime_of(model.get_base_model())


@dataclass
class Run:
    losses: list[float]
    adapters: dict[str, torch.Tensor]


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)


def train(model: torch.nn.Module, data: list[torch.Tensor]) -> list[float]:
    """One AdamW step per batch; the losses."""
    optimizer = adamw(model)
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def trained_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the trainable weights (adapters, ``modules_to_save``) by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def run(
    base: torch.nn.Module, config: LoraConfig, order: str, size: str, data: list[torch.Tensor]
) -> Run:
    """Wrap a copy of ``base`` in ``order``, train it on ``data``, detach; losses and weights."""
    model = wrap(copy.deepcopy(base), config, order, size)
    losses = train(model, data)
    autooffload.disable()  # detach: chunked weights become ordinary tensors again
    return Run(losses, trained_weights(model))


def assert_same_training(expected: Run, actual: Run) -> None:
    torch.testing.assert_close(
        torch.tensor(actual.losses), torch.tensor(expected.losses), rtol=RTOL, atol=ATOL
    )
    assert actual.adapters.keys() == expected.adapters.keys()
    for name, weight in expected.adapters.items():
        torch.testing.assert_close(actual.adapters[name], weight, rtol=RTOL, atol=ATOL, msg=name)
