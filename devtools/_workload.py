"""A bench workload's model, optimizer and batch under a real device cap (shared by dev tools)."""

from __future__ import annotations

from typing import Any

import torch

import autooffload
from autooffload.bench.models import accepted_batch, build_model, make_batch
from autooffload.bench.workloads import get_workload
from autooffload.setting_values import parse_size_or_fraction


def capped_workload(
    name: str,
    cap_text: str,
    bs: int | None = None,
    seq: int | None = None,
    gc: bool | None = None,
    **settings: Any,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, torch.Tensor]]:
    """Cap this process's device memory at ``cap_text`` (``set_per_process_memory_fraction``;
    "none": uncapped), enable autooffload with the workload's defaults and ``settings``, and
    build the workload's model (attached by its move to the GPU), an AdamW over its trainable
    params and its batch; ``bs``, ``seq`` and ``gc`` override the workload's (as the bench's
    ``--bs``, ``--seq``, ``--no-gc``)."""
    if cap_text != "none":
        cap = parse_size_or_fraction(cap_text, "cap")
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(cap / total)
    workload = get_workload(name, bs=bs, seq=seq, gc=gc)
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
