"""Tiny random-init Llamas and the CPU simulation of the runtime, for the runtime tests."""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import autooffload
from autooffload import runtime as rt

VOCAB = 128
SEQ = 16
BATCH = 2
# Bytes per chunk in the CPU simulation: a decoder layer of the tiny Llama (~37 KB) spans two
# chunks and the embedding (16 KB) one, so groups needing several chunks are exercised.
CHUNK_SIZE = 20_000


def tiny_llama(
    *, tied: bool = True, n_layers: int = 3, hidden: int = 32, seed: int = 0, vocab: int = VOCAB
) -> LlamaForCausalLM:
    """A random-init Llama small enough for CPU tests (hidden 32, vocab 128)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config).train()


def batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    """``n`` batches of token ids, the same for every run with the same seed."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator) for _ in range(n)]


def train_two_optimizers(
    model: torch.nn.Module, steps: int, every_other: int | None = None
) -> list[float]:
    """Train ``model`` ``steps`` steps with two optimizers: the embedding and head on fused AdamW
    stepping every backward, the layers on SGD with momentum stepping every backward
    (``every_other`` None) or only on steps with ``step % 2 == every_other``; the losses.
    Each optimizer's ``zero_grad`` follows its own ``step``."""
    named = list(model.named_parameters())
    vocab = [p for n, p in named if "embed" in n or "lm_head" in n]
    layers = [p for n, p in named if not ("embed" in n or "lm_head" in n)]
    every_step = torch.optim.AdamW(vocab, lr=1e-2, fused=True)
    layer_optimizer = torch.optim.SGD(layers, lr=0.1, momentum=0.9)
    losses = []
    for step, ids in enumerate(batches(steps)):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        every_step.step()
        every_step.zero_grad()
        if every_other is None or step % 2 == every_other:
            layer_optimizer.step()
            layer_optimizer.zero_grad()
    return losses


def enable_cpu(**overrides) -> autooffload.Settings:
    """Turn autooffload on in CPU simulation: a move to ``cpu`` of any trained model attaches.

    Label masking is off so that the runtime alone is under test.
    """
    settings = {
        "device": "cpu",
        "force_attach": True,
        "chunk_size": CHUNK_SIZE,
        "mask": False,
        "log": "warning",
        **overrides,
    }
    return autooffload.enable(**settings)


def n_chunks(model: torch.nn.Module, chunk_size: int = CHUNK_SIZE) -> int:
    """How many chunks ``model`` is laid into: attach a copy explicitly, count, detach it."""
    probe = copy.deepcopy(model)
    runtime = autooffload.attach(probe, device="cpu", chunk_size=chunk_size, n_persist=0)
    count = len(runtime.layout.chunks)
    rt.detach(probe)
    return count
