"""Supervised fine-tuning of a random-init Llama with TRL's SFTTrainer, under autooffload.

    python examples/trl_sft.py                       # tiny model, CPU, seconds
    python examples/trl_sft.py --size 1b --steps 20  # TinyLlama-1.1B dimensions, on a GPU
    python examples/trl_sft.py --steps 8 --save-steps 4 --output-dir out/

The data is ``examples/data/chat.jsonl`` in TRL's conversational ``messages`` format; the
tokenizer (and its chat template) is the Qwen3 one in ``tests/data/tokenizers/qwen3``; nothing is
downloaded.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig
from trl import SFTConfig, SFTTrainer

import autooffload

autooffload.enable()

REPO = Path(__file__).resolve().parents[1]
SIZES = {
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


def dump_logits(model: torch.nn.Module, input_ids: list[int], path: str) -> None:
    """Save the model's logits on one fixed sequence (under bf16 autocast on a GPU, as every
    example does), to compare with a plain model loaded from the saved checkpoint."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ids = torch.tensor([input_ids], device=device)
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        logits = model(input_ids=ids).logits
    torch.save({"input_ids": ids.cpu(), "logits": logits.float().cpu()}, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--data", default=str(REPO / "examples/data/chat.jsonl"))
    parser.add_argument("--tokenizer", default=str(REPO / "tests/data/tokenizers/qwen3"))
    parser.add_argument("--output-dir", default=None, help="default: a temporary directory")
    parser.add_argument("--save-steps", type=int, default=None, help="default: no checkpoints")
    parser.add_argument("--dump-logits", default=None, help="save logits of a fixed batch here")
    args = parser.parse_args()

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    with open(args.data) as lines:
        train_dataset = Dataset.from_list([json.loads(line) for line in lines if line.strip()])

    use_cuda = torch.cuda.is_available()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **SIZES[args.size],
    )
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.bfloat16 if use_cuda else torch.float32
    )

    with tempfile.TemporaryDirectory() as scratch:
        sft_config = SFTConfig(
            output_dir=args.output_dir or scratch,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch_size,
            learning_rate=args.lr,
            max_length=512,
            logging_steps=1,
            save_strategy="no" if args.save_steps is None else "steps",
            save_steps=args.save_steps,
            report_to="none",
            bf16=use_cuda,
            disable_tqdm=True,
        )
        trainer = SFTTrainer(
            model=model,
            args=sft_config,
            train_dataset=train_dataset,
            processing_class=tokenizer,
        )
        trainer.train()

    if args.dump_logits is not None:
        first = tokenizer.apply_chat_template(train_dataset[0]["messages"], tokenize=True)
        dump_logits(trainer.model, first["input_ids"], args.dump_logits)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"losses: {' '.join(f'{loss:.4f}' for loss in losses)}")
    plan = autooffload.last_plan()
    print(plan.summary() if plan is not None else "plan: none (the model was not attached)")


if __name__ == "__main__":
    main()
