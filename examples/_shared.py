"""What the examples share that is not their lesson: the chat examples' model sizes and model,
and the logits dump that ``tests/gpu/test_e2e_gpu.py`` compares with a plain model loaded from
the saved checkpoint. Each example imports it from its own folder (``python examples/NAME.py``
puts that folder on ``sys.path``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel, PreTrainedTokenizerBase

REPO = Path(__file__).resolve().parents[1]

# Llama shapes for the chat examples; the vocabulary is the tokenizer's.
CHAT_SIZES = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    # TinyLlama-1.1B (with the tokenizer's vocabulary)
    "1b": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
    # Llama-3.2-3B (with the tokenizer's vocabulary)
    "3b": dict(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
}


def chat_model(tokenizer: PreTrainedTokenizerBase, size: str) -> PreTrainedModel:
    """A random-init Llama of ``CHAT_SIZES[size]`` with the tokenizer's vocabulary and special
    tokens: bf16 on a GPU, fp32 on the CPU."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **CHAT_SIZES[size],
    )
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def dump_logits(model: torch.nn.Module, input_ids: list[int], path: str) -> None:
    """Save the model's logits on one fixed sequence (under bf16 autocast on a GPU, as every
    example does), to compare with a plain model loaded from the saved checkpoint."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ids = torch.tensor([input_ids], device=device)
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        logits = model(input_ids=ids).logits
    torch.save({"input_ids": ids.cpu(), "logits": logits.float().cpu()}, path)


def chat_arguments(
    description: str, data: str = "chat.jsonl", steps: int = 5, steps_help: str | None = None
) -> argparse.ArgumentParser:
    """The arguments every chat example takes: model size, steps, batch size, learning rate,
    data file (in ``examples/data``) and tokenizer (the in-repo Qwen3 one)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--size", choices=sorted(CHAT_SIZES), default="tiny")
    parser.add_argument("--steps", type=int, default=steps, help=steps_help)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--data", default=str(REPO / "examples/data" / data))
    parser.add_argument("--tokenizer", default=str(REPO / "tests/data/tokenizers/qwen3"))
    return parser


def read_jsonl(path: str) -> list[dict]:
    """The records of a JSON-lines file, blank lines skipped."""
    with open(path) as lines:
        return [json.loads(line) for line in lines if line.strip()]


def print_losses_and_plan(trainer: Any) -> None:
    """After a Trainer's run: its logged losses on one line, then the last attached model's plan
    (the lines the example tests read)."""
    import autooffload

    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"losses: {' '.join(f'{loss:.4f}' for loss in losses)}")
    print(plan_text(autooffload.last_plan()))


def plan_text(plan: Any) -> str:
    """The plan's summary in the words of the device it ran on (the CPU simulation's host
    memory is "the device"), or a line saying nothing was attached."""
    import torch

    if plan is None:
        return "plan: none (the model was not attached)"
    return plan.summary("cuda" if torch.cuda.is_available() else "cpu")
