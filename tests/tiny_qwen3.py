"""A random-init Qwen3 over the real Qwen3 tokenizer's whole vocabulary, for tests that render
real chat templates (masking through TRL's script, FSDP2 with masking)."""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM


def tiny_qwen3(
    vocab: int, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> Qwen3ForCausalLM:
    """Hidden 32, three layers, an untied head; the same weights for the same ``vocab``."""
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    return Qwen3ForCausalLM(config).to(device=device, dtype=dtype).train()
