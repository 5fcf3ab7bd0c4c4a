"""One rank of the HF Trainer data-parallel test, launched by ``torchrun --nproc-per-node 2``.

Trains the same tiny Llama twice with an unchanged ``transformers.Trainer`` on CPU (gloo DDP, as
``torchrun`` + ``use_cpu=True`` sets it up): plain, then with autooffload enabled (the CPU
simulation attaches the model when the Trainer moves it). Writes ``<out>/rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).parents[1] / "runtime"))
from runtime_models import CHUNK_SIZE, VOCAB, tiny_llama  # noqa: E402

import autooffload  # noqa: E402
from autooffload import runtime as rt  # noqa: E402

STEPS = 6


class Rows(torch.utils.data.Dataset):
    """Fixed random rows: the Trainer's distributed sampler gives each rank its half."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(11)
        self.ids = torch.randint(0, VOCAB, (4 * STEPS, 16), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def enable_cpu() -> None:
    """The CPU simulation: the Trainer's / accelerate's move to ``cpu`` attaches the model."""
    autooffload.enable(
        device="cpu", force_attach=True, chunk_size=CHUNK_SIZE, mask=False, log="warning"
    )


def train(out: Path, attached: bool) -> tuple[dict[str, torch.Tensor], dict]:
    if attached:
        enable_cpu()
    model = tiny_llama()
    args = TrainingArguments(
        output_dir=str(out / ("attached" if attached else "plain")),
        per_device_train_batch_size=2,
        max_steps=STEPS,
        learning_rate=1e-2,
        max_grad_norm=1.0,
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Rows())
    trainer.train()
    facts = {}
    if attached:
        runtime = rt.runtime_of(model)
        facts["attached"] = runtime is not None
        facts["data_parallel"] = runtime is not None and runtime.data_parallel is not None
        wrapped = trainer.model_wrapped
        facts["wrapper"] = type(wrapped).__name__
        facts["pass_through"] = getattr(wrapped, "_autooffload_runtimes", None) is not None
    if attached:
        autooffload.consolidate(model, to=None)  # every rank reads its state dict below
    weights = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    if attached:
        autooffload.disable()
    return weights, facts


def accelerate_loop(attached: bool, out: Path) -> dict[str, torch.Tensor]:
    """An accelerate loop: prepare (DDP), accumulate over 2 micro-batches, clip, step, then
    ``save_state`` into ``out`` (the sharded optimizer state gathered by autooffload's patch),
    one more step, and ``load_state`` back (every rank reads ``model.state_dict()`` there)."""
    from accelerate import Accelerator

    if attached:
        enable_cpu()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    rows = Rows().ids
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(2 * STEPS):
        ids = rows[2 * step : 2 * step + 2].chunk(world)[rank]
        with accelerator.accumulate(model):
            accelerator.backward(model(input_ids=ids, labels=ids).loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
    accelerator.save_state(str(out))
    # One more step, back to the saved state (load_state must restore the weights), and one
    # step from there (it must restore the optimizer state too).
    one_step = range(2)
    for step in (*one_step, "load", *one_step):
        if step == "load":
            accelerator.load_state(str(out))
            continue
        ids = rows[2 * step : 2 * step + 2].chunk(world)[rank]
        with accelerator.accumulate(model):
            accelerator.backward(model(input_ids=ids, labels=ids).loss)
            optimizer.step()
            optimizer.zero_grad()
    inner = accelerator.unwrap_model(model)
    if attached:
        autooffload.consolidate(inner, to=None)  # every rank reads its state dict below
    weights = {k: v.detach().float().clone() for k, v in inner.state_dict().items()}
    if attached:
        assert rt.runtime_of(inner) is not None, "the accelerate model was not attached"
        autooffload.disable()
    return weights


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    report: dict = {}
    try:
        plain, _ = train(args.out, attached=False)
        attached, facts = train(args.out, attached=True)
        report.update(facts)
        report["rank"] = dist.get_rank()
        report["max_diff_vs_plain_ddp"] = max(
            (plain[k] - attached[k]).abs().max().item() for k in plain
        )
        flat = torch.cat([t.reshape(-1) for t in attached.values()])
        gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flat)
        report["ranks_identical"] = all(torch.equal(g, gathered[0]) for g in gathered)
        plain_acc = accelerate_loop(False, args.out / "acc_plain")
        attached_acc = accelerate_loop(True, args.out / "acc_attached")
        report["accelerate_max_diff_vs_plain"] = max(
            (plain_acc[k] - attached_acc[k]).abs().max().item() for k in plain_acc
        )
        dist.barrier()
        saved = [
            torch.load(args.out / name / "optimizer.bin", weights_only=True)["state"]
            for name in ("acc_plain", "acc_attached")
        ]
        report["saved_state_params"] = [len(state) for state in saved]
        report["saved_state_max_diff"] = max(
            (saved[0][i][key] - saved[1][i][key]).abs().max().item()
            for i in saved[0]
            for key in ("exp_avg", "exp_avg_sq")
        )
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        report["error"] = traceback.format_exc()
    rank = dist.get_rank() if dist.is_initialized() else 0
    (args.out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
