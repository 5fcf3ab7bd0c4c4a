"""What every bench peer is built from: the context a peer sets up in, the ``Trainee`` it
returns (one training step, its report), and the AdamW all peers train with."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autooffload.bench.workloads import Workload


class PeerUnavailable(Exception):
    """The peer cannot run here (missing dependency, unsupported mode); the message says why."""


@dataclass
class PeerContext:
    """What a peer's setup gets: the workload, where to run, the memory cap and its options."""

    workload: Workload
    device: str
    cap_bytes: int | None
    seed: int
    options: dict[str, Any] = field(default_factory=dict)


class Trainee:
    """A model and optimizer ready to train; ``step`` runs ``accum`` forward/backward passes
    (gradient accumulation: each loss scaled by 1/accum, the cross-rank gradient sync skipped
    for all but the last, as HF Trainer and accelerate do), then one update."""

    accum: int = 1

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        total = None
        for micro in range(self.accum):
            with self.sync_context(last=micro == self.accum - 1):
                loss = self.forward(batch)
                (loss / self.accum if self.accum > 1 else loss).backward()
            loss = loss.detach()
            total = loss if total is None else total + loss
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total / self.accum

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """One micro-batch's loss."""
        return self.model(**batch).loss

    def sync_context(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """Around a micro-batch's forward and backward: DDP's ``no_sync`` for all but the last."""
        if not last and isinstance(self.model, nn.parallel.DistributedDataParallel):
            return self.model.no_sync()
        return contextlib.nullcontext()

    def on_timing_start(self) -> None:
        """Called after warm-up, before the first timed step."""

    def on_step_end(self) -> None:
        """Called after every step (warm-up included), once the device is synchronised."""

    def settled(self) -> bool:
        """Whether the peer has reached its steady state (the warm-up goes on until then, up
        to a limit): autooffload's plan has passed its first checks."""
        return True

    def report(self, timed_steps: int) -> dict[str, Any]:
        """Peer-specific fields for the result (breakdown, plan); never raises."""
        return {}

    def failure_report(self) -> dict[str, Any]:
        """Peer-specific fields for a run that failed (what it planned from); never raises."""
        return {}

    def close(self) -> None:
        """Release process-wide state (process groups, patches)."""


def adamw(model: nn.Module, ctx: PeerContext, fused: bool | None = None) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    if fused is None:
        fused = ctx.device == "cuda"
    return torch.optim.AdamW(params, lr=ctx.workload.lr, weight_decay=0.0, fused=fused)


def data_parallel() -> bool:
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_world_size() > 1
