"""The bench worker's step loop: the warm-up waits for a peer to settle, within a limit."""

from __future__ import annotations

import pytest
import torch

from autooffload.bench import _worker, models
from autooffload.bench.workloads import get_workload


class _Settling:
    """A trainee that reaches its steady state after ``settles_after`` steps."""

    model = None

    def __init__(self, settles_after: int) -> None:
        self.settles_after = settles_after
        self.steps = 0
        self.timing_started_at: int | None = None

    def step(self, batch: dict) -> torch.Tensor:
        self.steps += 1
        return torch.tensor(float(self.steps))  # the loss says which step it was

    def settled(self) -> bool:
        return self.steps >= self.settles_after

    def on_timing_start(self) -> None:
        self.timing_started_at = self.steps

    def on_step_end(self) -> None:
        pass


@pytest.mark.parametrize(
    ("settles_after", "warmup_run"),
    [(0, 3), (3, 3), (6, 6), (1000, 3 + _worker.EXTRA_WARMUP_LIMIT)],
)
def test_the_warm_up_goes_on_until_the_peer_settles(monkeypatch, settles_after, warmup_run):
    monkeypatch.setattr(models, "accepted_batch", lambda model, batch: batch)
    trainee = _Settling(settles_after)
    spec = {"device": "cpu", "warmup": 3, "steps": 2, "seed": 0}
    out = _worker._train(trainee, spec, get_workload("llama-tiny", None, None, None), {})
    assert out["warmup"] == warmup_run
    assert trainee.timing_started_at == warmup_run
    assert trainee.steps == warmup_run + 2
    assert len(out["step_s"]) == warmup_run + 2, "the timed steps were not all run"
    # Peers are compared at the step every peer reaches: the requested warm-up plus the timed.
    assert out["loss_final"] == 3 + 2
    assert out["loss_last"] == warmup_run + 2
