"""One rank of the ``fsdp2_wrap`` tests, launched by ``torchrun``: a chat batch collated under
``enable()`` (masking on) trains an FSDP2 model wrapped by ``autooffload.fsdp2_wrap`` with HF
gradient checkpointing; then plain FSDP2 with the same wrap, without autooffload, trains the same
model on the same labels. Writes ``<out>/rank<r>.json``."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from tiny_qwen3 import tiny_qwen3  # noqa: E402
from tokenizer_data import tokenizer_dir  # noqa: E402

import autooffload  # noqa: E402

STEPS = 4
CHAT = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is {a}+{b}?"},
    {"role": "assistant", "content": "It is {c}."},
]


def chat_batches(tokenizer, rank: int, world: int) -> list[dict[str, list]]:
    """This rank's share of the chat features of every step (different sums on each)."""
    steps = []
    for step in range(STEPS):
        features = []
        for row in range(2):
            a, b = step + 1, rank * 10 + row
            chat = [{**m, "content": m["content"].format(a=a, b=b, c=a + b)} for m in CHAT]
            ids = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)
            features.append({"input_ids": list(ids["input_ids"])})
        steps.append(features)
    return steps


def train(model: torch.nn.Module, batches: list[dict], lr: float = 1e-2) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().float().cpu() for k, v in model.state_dict().items()}


def run(device: str, dtype: torch.dtype, rank: int, world: int) -> dict:
    from transformers import AutoTokenizer, DataCollatorForLanguageModeling

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir("qwen3"))
    features = chat_batches(tokenizer, rank, world)
    plain_collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    unmasked = [plain_collator(f) for f in features]

    autooffload.enable(device=device, mask=True, log="warning")
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    batches = [{k: v.to(device) for k, v in collator(f).items()} for f in features]
    model = tiny_qwen3(len(tokenizer), device, dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    autooffload.fsdp2_wrap(model, min_num_params=layer)
    model.to(device)
    attached = autooffload.runtime.runtime_of(model) is not None
    losses = train(model, batches)
    enabled_weights = full_weights(model)
    autooffload.disable()

    plain = tiny_qwen3(len(tokenizer), device, dtype)
    plain.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    autooffload.fsdp2_wrap(plain, min_num_params=layer)
    plain_losses = train(plain, batches)
    plain_weights = full_weights(plain)

    kept = [
        tokenizer.decode(ids[labels != -100].tolist())
        for b in batches
        for ids, labels in zip(b["input_ids"].cpu(), b["labels"].cpu())
    ]
    return {
        "attached": attached,
        "losses": losses,
        "plain_losses": plain_losses,
        "weights_max_diff": max(
            (enabled_weights[k] - v).abs().max().item() for k, v in plain_weights.items()
        ),
        "kept_label_texts": kept,
        "masked_tokens": sum(int((b["labels"] == -100).sum()) for b in batches),
        "unmasked_tokens": sum(int((b["labels"] == -100).sum()) for b in unmasked),
        "units": sum(1 for m in model.modules() if type(m).__name__.startswith("FSDP")),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo", timeout=datetime.timedelta(seconds=120)
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    report: dict = {"rank": rank, "world": world}
    try:
        report.update(run(device, getattr(torch, args.dtype), rank, world))
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        report["error"] = traceback.format_exc()
    (args.out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
