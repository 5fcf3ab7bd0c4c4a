"""Fine-tune a random-init Llama on chat data with an accelerate training loop, under autooffload.

    python examples/accelerate_loop.py                       # tiny model, CPU, seconds
    python examples/accelerate_loop.py --size 1b --steps 20  # TinyLlama-1.1B dimensions, on a GPU
    python examples/accelerate_loop.py --steps 8 --resume    # continue from --output-dir's state

A hand-written loop: ``Accelerator(gradient_accumulation_steps=...)``, ``prepare``,
``accumulate``, ``backward``, ``clip_grad_norm_``, a linear LR schedule, and ``save_state`` at the
end (``load_state`` with ``--resume``). The data is ``examples/data/chat.jsonl`` tokenized with the
Qwen3 chat template from ``tests/data/tokenizers/qwen3``; nothing is downloaded. The collate
function sets ``labels`` to the input ids; autooffload's masking turns them into assistant-only
labels in the model's forward.
"""

from __future__ import annotations

import tempfile

import torch
from _shared import chat_arguments, chat_model, dump_logits, plan_text, read_jsonl
from accelerate import Accelerator
from transformers import AutoTokenizer, get_scheduler

import autooffload

autooffload.enable()


class Progress:
    """The optimizer steps taken so far; saved and restored with the accelerator's state."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def collate(rows: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch of token lists; labels are the input ids, -100 on padding."""
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        input_ids[index, : len(row)] = torch.tensor(row)
        attention_mask[index, : len(row)] = 1
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def main() -> None:
    parser = chat_arguments(__doc__.splitlines()[0], steps_help="optimizer steps in all")
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--output-dir", default=None, help="save_state here; default: a temp dir")
    parser.add_argument("--resume", action="store_true", help="load_state from --output-dir first")
    parser.add_argument("--dump-logits", default=None, help="save logits of a fixed batch here")
    args = parser.parse_args()
    if args.resume and args.output_dir is None:
        parser.error("--resume needs --output-dir (the directory save_state wrote)")

    torch.manual_seed(0)
    use_cuda = torch.cuda.is_available()
    accelerator = Accelerator(
        gradient_accumulation_steps=args.grad_accum, mixed_precision="bf16" if use_cuda else "no"
    )
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    conversations = [record["messages"] for record in read_jsonl(args.data)]
    rows = [
        tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]
        for messages in conversations
    ]
    loader = torch.utils.data.DataLoader(
        rows,
        batch_size=args.batch_size,
        shuffle=False,
        collate_fn=lambda batch: collate(batch, tokenizer.pad_token_id),
    )

    model = chat_model(tokenizer, args.size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = get_scheduler(
        "linear", optimizer, num_warmup_steps=0, num_training_steps=args.steps
    )
    # The move to the device inside prepare attaches the model.
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if args.resume:
        accelerator.load_state(args.output_dir)
        print(f"resumed from step {progress.step}", flush=True)

    model.train()
    losses: list[float] = []
    micro_losses: list[float] = []
    # Skip the micro-batches the saved steps consumed, so a resumed run sees the same data.
    skip = progress.step * args.grad_accum % len(loader)
    while progress.step < args.steps:
        epoch = accelerator.skip_first_batches(loader, skip) if skip else loader
        skip = 0
        for batch in epoch:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            micro_losses.append(loss.item())
            if accelerator.sync_gradients:
                progress.step += 1
                losses.append(sum(micro_losses) / len(micro_losses))
                micro_losses = []
                print(f"step {progress.step}/{args.steps} loss {losses[-1]:.4f}", flush=True)
                if progress.step == args.steps:
                    break

    with tempfile.TemporaryDirectory() as scratch:
        accelerator.save_state(args.output_dir or scratch)
    if args.output_dir is not None and accelerator.is_main_process:
        # save_state writes model.safetensors; with the config beside it, from_pretrained loads it.
        accelerator.unwrap_model(model).config.save_pretrained(args.output_dir)
    if args.dump_logits is not None:
        dump_logits(model, rows[0], args.dump_logits)

    print(f"losses: {' '.join(f'{loss:.4f}' for loss in losses)}")
    print(plan_text(autooffload.last_plan()))


if __name__ == "__main__":
    main()
