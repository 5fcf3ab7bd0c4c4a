"""After the first planned steps, a measured peak above the prediction calibrates the
fragmentation factor and re-plans (issue 13), keeping the persistent chunks."""

from __future__ import annotations

import logging

import pytest
import torch

from autooffload import runtime as rt
from autooffload.plan.cost import predict_peak_bytes
from autooffload.runtime.planning import CALIBRATION_MARGIN, calibrate_after_steps

pytestmark = pytest.mark.usefixtures("one_thread")


def _planned(make_llama, offload_cpu, make_batches, budget):
    model = make_llama(n_layers=4)
    offload_cpu(budget=budget)
    model.to("cpu")
    runtime = rt.runtime_of(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for ids in make_batches(3):  # two profiling steps, then the searched plan
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert runtime.plan.source == "search"
    return runtime


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_peak_over_the_prediction_recalibrates_and_replans(make_llama, offload_cpu, make_batches):
    # A budget just above this tiny model's planned peak (~0.7 MB), so 1.3x of it does not fit.
    runtime = _planned(make_llama, offload_cpu, make_batches, 760_000)
    plan = runtime.plan
    predicted = plan.predicted_peak_bytes
    assert calibrate_after_steps(runtime, int(predicted * (1 + CALIBRATION_MARGIN / 2))) is None
    assert runtime.plan is plan, "a peak within the margin changed the plan"

    old_factor = runtime.profile.fragmentation_factor
    logger, records = logging.getLogger("autooffload"), _Records()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(records)
    try:
        new_plan = calibrate_after_steps(runtime, int(predicted * 1.3))
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    text = "\n".join(records.lines)
    factor = runtime.profile.fragmentation_factor
    assert factor == pytest.approx(old_factor * 1.3, rel=0.02)
    assert len(records.lines) == 1 and "measured peak" in text, text
    assert new_plan is not None, text
    assert runtime.plan is new_plan and new_plan.n_persist == plan.n_persist
    assert new_plan.knobs != plan.knobs
    # The calibrated model predicts the old plan over budget, the new one within it.
    hw = runtime.search_request.hw
    assert predict_peak_bytes(runtime.profile, hw, plan.knobs) > new_plan.budget_bytes
    assert new_plan.predicted_peak_bytes <= new_plan.budget_bytes
    assert rt.last_plan() is new_plan


def test_the_runtime_checks_the_peak_two_steps_after_the_switch(
    make_llama, offload_cpu, make_batches, monkeypatch
):
    """On a GPU the check runs by itself; here the step counter is armed by hand (the CPU
    simulation has no device peak) and the measurement is injected."""
    from autooffload.runtime import runtime as runtime_module

    seen = []
    monkeypatch.setattr(
        runtime_module, "calibrate_after_steps", lambda r, peak: seen.append((r, peak))
    )
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 123)
    runtime = _planned(make_llama, offload_cpu, make_batches, None)
    runtime.calibrate_at_step = runtime.steps_taken + 2
    model = runtime.model
    optimizer = runtime.optimizers[0]
    for ids in make_batches(3):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert seen == [(runtime, 123)], "checked never, or more than once"
