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

import tempfile

import torch
from _shared import chat_arguments, chat_model, dump_logits, print_losses_and_plan, read_jsonl
from transformers import (
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    Trainer,
    TrainingArguments,
)

import autooffload

autooffload.enable()


def main() -> None:
    parser = chat_arguments(__doc__.splitlines()[0])
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
    conversations = [record["messages"] for record in read_jsonl(args.data)]
    train_dataset = [
        {"input_ids": tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]}
        for messages in conversations
    ]

    use_cuda = torch.cuda.is_available()
    model = chat_model(tokenizer, args.size)

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
    print_losses_and_plan(trainer)


if __name__ == "__main__":
    main()
