"""Fine-tune a random-init Llama on chat data with the Hugging Face Trainer, under autooffload.

    python examples/hf_trainer.py                       # tiny model, CPU, seconds
    python examples/hf_trainer.py --size 1b --steps 20  # TinyLlama-1.1B dimensions, on a GPU
    python examples/hf_trainer.py --steps 8 --save-steps 4 --grad-accum 2 --output-dir out/
    python examples/hf_trainer.py --steps 8 --grad-accum 2 --resume out/checkpoint-4

The data is ``examples/data/chat.jsonl`` (one ``{"messages": [...]}`` per line), tokenized with the
Qwen3 chat template from ``tests/data/tokenizers/qwen3``; nothing is downloaded. The collator is
the stock ``DataCollatorForLanguageModeling``: labels are every token until autooffload's
masking turns them into assistant-only labels.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    LlamaConfig,
    Trainer,
    TrainingArguments,
)

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
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--output-dir", default=None, help="default: a temporary directory")
    parser.add_argument("--save-steps", type=int, default=None, help="default: no checkpoints")
    parser.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=None,
        help="resume_from_checkpoint: the last checkpoint in --output-dir, or the one named",
    )
    parser.add_argument("--dump-logits", default=None, help="save logits of a fixed batch here")
    args = parser.parse_args()

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    with open(args.data) as lines:
        conversations = [json.loads(line)["messages"] for line in lines if line.strip()]
    train_dataset = [
        {"input_ids": tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]}
        for messages in conversations
    ]

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
        training_args = TrainingArguments(
            output_dir=args.output_dir or scratch,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch_size,
            gradient_accumulation_steps=args.grad_accum,
            max_grad_norm=args.max_grad_norm,
            learning_rate=args.lr,
            logging_steps=1,
            save_strategy="no" if args.save_steps is None else "steps",
            save_steps=args.save_steps,
            report_to=[],
            bf16=use_cuda,
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=model,
            args=training_args,
            train_dataset=train_dataset,
            data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
            processing_class=tokenizer,
        )
        trainer.train(resume_from_checkpoint=args.resume)

    if args.dump_logits is not None:
        dump_logits(trainer.model, train_dataset[0]["input_ids"], args.dump_logits)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"losses: {' '.join(f'{loss:.4f}' for loss in losses)}")
    plan = autooffload.last_plan()
    print(plan.summary() if plan is not None else "plan: none (the model was not attached)")


if __name__ == "__main__":
    main()
