"""A bench workload's model, optimizer and batch under a real device cap (shared by dev tools)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

import autooffload
from autooffload.bench.models import accepted_batch, build_model, make_batch
from autooffload.bench.workloads import get_workload
from autooffload.setting_values import parse_size_or_fraction

# Packages whose frames name an allocation site in the allocator's history (``where``).
INTERESTING = ("autooffload/", "transformers/", "peft/", "torch/utils/checkpoint", "torch/optim")


def record_allocations(max_entries: int) -> None:
    """Record the allocator's allocations with their Python frames. Allocations only: recording
    frees too ("all") breaks checkpoint recomputation in torch 2.11 (pytorch/pytorch#179536: a
    SystemError in the recompute)."""
    torch.cuda.memory._record_memory_history(
        max_entries=max_entries, context="alloc", stacks="python"
    )


def where(frames: list[dict], depth: int = 2) -> str:
    """The innermost ``depth`` frames of ``INTERESTING`` packages in an allocation's stack."""
    out = []
    for frame in frames:
        path = frame.get("filename", "")
        if any(key in path for key in INTERESTING):
            short = "/".join(path.split("/")[-2:])
            out.append(f"{short}:{frame.get('line')} {frame.get('name')}")
            if len(out) == depth:
                break
    return " <- ".join(out) if out else (frames[0].get("name", "?") if frames else "?")


def capped_workload(
    name: str,
    cap_text: str,
    bs: int | None = None,
    seq: int | None = None,
    gc: bool | None = None,
    layers: int | None = None,
    **settings: Any,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, torch.Tensor]]:
    """Cap this process's device memory at ``cap_text`` (``set_per_process_memory_fraction``;
    "none": uncapped), enable autooffload with the workload's defaults and ``settings``, and
    build the workload's model (attached by its move to the GPU), an AdamW over its trainable
    params and its batch; ``bs``, ``seq``, ``gc`` and ``layers`` override the workload's (as the
    bench's ``--bs``, ``--seq``, ``--no-gc``, ``--layers``)."""
    if cap_text != "none":
        cap = parse_size_or_fraction(cap_text, "cap")
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(cap / total)
    workload = get_workload(name, bs=bs, seq=seq, gc=gc, layers=layers)
    autooffload.enable(**{**workload.autooffload_defaults, **settings})
    model = build_model(workload).to("cuda")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=workload.lr, weight_decay=0.0, fused=True)
    batch = {k: v.to("cuda") for k, v in accepted_batch(model, make_batch(workload)).items()}
    return model, optimizer, batch


def plain_workload(
    name: str,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, torch.Tensor]]:
    """The workload's model, uncapped and without autooffload, its fused AdamW and batch."""
    workload = get_workload(name)
    model = build_model(workload).to("cuda")  # HF gradient checkpointing if the workload has it
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    batch = {k: v.to("cuda") for k, v in accepted_batch(model, make_batch(workload)).items()}
    return model, optimizer, batch


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """A dev tool's workload arguments, as the bench spells them: the workload, the cap, and
    ``--bs``, ``--seq``, ``--no-gc``, ``--layers``, ``--steps``, ``--settings``, ``--budget``."""
    parser.add_argument("workload")
    parser.add_argument("cap")
    parser.add_argument("--bs", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--no-gc", action="store_true")
    parser.add_argument("--layers", type=int, help="the text model's block count")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--settings", default="{}", help="JSON of extra enable() settings")
    parser.add_argument("--budget", help="the planner's budget (default: the cap)")


def workload_from_arguments(
    args: argparse.Namespace, **settings: Any
) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, torch.Tensor]]:
    """``capped_workload`` for ``add_workload_arguments``' arguments, ``--settings`` over
    ``settings``."""
    return capped_workload(
        args.workload,
        args.cap,
        bs=args.bs,
        seq=args.seq,
        gc=False if args.no_gc else None,
        layers=args.layers,
        budget=parse_size_or_fraction(args.budget or args.cap, "budget"),
        **{**settings, **json.loads(args.settings)},
    )
