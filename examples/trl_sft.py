"""Supervised fine-tuning of a random-init Llama with TRL's SFTTrainer, under autooffload.

    python examples/trl_sft.py                       # tiny model, CPU, seconds
    python examples/trl_sft.py --size 1b --steps 20  # TinyLlama-1.1B dimensions, on a GPU
    python examples/trl_sft.py --steps 8 --save-steps 4 --output-dir out/

The data is ``examples/data/chat.jsonl`` in TRL's conversational ``messages`` format; the
tokenizer (and its chat template) is the Qwen3 one in ``tests/data/tokenizers/qwen3``; nothing is
downloaded.
"""

from __future__ import annotations

import tempfile

import torch
from _shared import chat_arguments, chat_model, dump_logits, print_losses_and_plan, read_jsonl
from datasets import Dataset
from transformers import AutoTokenizer
from trl import SFTConfig, SFTTrainer

import autooffload

autooffload.enable()


def main() -> None:
    parser = chat_arguments(__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default=None, help="default: a temporary directory")
    parser.add_argument("--save-steps", type=int, default=None, help="default: no checkpoints")
    parser.add_argument("--dump-logits", default=None, help="save logits of a fixed batch here")
    args = parser.parse_args()

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    train_dataset = Dataset.from_list(read_jsonl(args.data))

    use_cuda = torch.cuda.is_available()
    model = chat_model(tokenizer, args.size)

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
    print_losses_and_plan(trainer)


if __name__ == "__main__":
    main()
