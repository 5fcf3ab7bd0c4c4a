"""What a calibration check concludes from a measured step: a profile whose compute times are
off is re-derived so that the running plan's prediction is the measured step."""

from __future__ import annotations

from dataclasses import replace

import pytest
from plan_profiles import MiB, make_hardware, make_profile

from autooffload.plan import replan
from autooffload.plan.calibration_model import COMPUTE_SCALE_FIT, calibrate_compute_cap
from autooffload.plan.cost_time import predict_step_time
from autooffload.plan.profile_types import HardwareProfile, ModelProfile
from autooffload.plan.replan import Measured, calibrated
from autooffload.plan.search import SearchRequest
from autooffload.plan.types import Plan

# A one-off stall in the profiling step's span of the head and the loss (3.6B on a 16-core
# H200: ~1.45 s of post forward, 1,858 ms predicted, 412 ms measured).
STALL_S = 1.0


def _stalled(profile: ModelProfile, stall_s: float = STALL_S) -> ModelProfile:
    return replace(profile, post=replace(profile.post, fwd_s=profile.post.fwd_s + stall_s))


def _step(profile: ModelProfile, hw: HardwareProfile, plan: Plan) -> float:
    """The step ``plan`` runs when ``profile`` holds the true times."""
    return predict_step_time(replan.running_variant(profile, plan, hw), hw, plan.knobs)[0]


@pytest.mark.parametrize(
    ("fwd_s", "budget_mib"),
    [
        (0.002, 1600),  # bound by the CPU update: no compute scale reaches the measured step
        (0.005, None),  # compute-bound: a scale reaches it with every block ~10x too fast
    ],
)
def test_a_stall_in_one_profiled_span_is_taken_out_at_the_first_check(fwd_s, budget_mib):
    """The stalled forward outlasts the whole measured step: the first check cuts it to what
    the step leaves it, every other unit keeps its profiled times, the running plan's prediction
    is the measured step, and the log's words name the time that was cut."""
    cpu_rate = 2e9
    true = make_profile(n_blocks=8, fwd_s=fwd_s)
    hw = make_hardware(cpu_optim_params_per_s=cpu_rate)
    stalled = _stalled(true)
    budget = budget_mib * MiB if budget_mib else None
    request = SearchRequest({stalled.chunk_size: stalled}, hw, budget)
    plan = request.plan()
    measured = _step(true, hw, plan)
    assert plan.predicted_step_s > 4 * measured
    found = calibrated(
        plan,
        request,
        stalled,
        stalled.chunk_size,
        Measured(plan.predicted_peak_bytes, cpu_rate, measured),
    )
    assert found is not None, "the profiled prediction stayed"
    assert found.profile.post.fwd_s == pytest.approx(true.post.fwd_s, rel=1e-3)
    assert found.profile.blocks == true.blocks and found.profile.pre == true.pre
    assert found.profile.post.bwd_s == true.post.bwd_s
    assert "the profiled compute times were an outlier" in found.what, found.what
    assert f"post forward {stalled.post.fwd_s * 1e3:.0f} ms outlasted" in found.what, found.what
    assert isinstance(found.outcome, Plan) and found.outcome.configures_like(plan)
    assert found.outcome.predicted_step_s == pytest.approx(measured, rel=COMPUTE_SCALE_FIT)


def test_a_profile_slow_in_every_unit_is_scaled_as_before():
    """No unit outlasts the step: the miss is every unit's, and one factor scales them all."""
    true = make_profile(n_blocks=8, fwd_s=0.005)
    hw = make_hardware()
    slow = true.with_compute_scaled(3.0)
    request = SearchRequest({slow.chunk_size: slow}, hw, None)
    plan = request.plan()
    measured = _step(true, hw, plan)
    assert max(max(u.fwd_s, u.bwd_s) for u in slow.units) < measured
    found = calibrated(
        plan, request, slow, slow.chunk_size, Measured(plan.predicted_peak_bytes, None, measured)
    )
    assert found is not None and "compute x0.33" in found.what, found and found.what
    assert found.profile.blocks[0].fwd_s == pytest.approx(true.blocks[0].fwd_s, rel=0.01)


def test_a_cap_needs_a_few_units_outlasting_a_step_it_can_reach():
    """Declined: no time outlasts the step; half the units' do (no one-off stall); a step
    faster than the prediction with the stalled time cut to nothing."""
    true = make_profile(n_blocks=8, fwd_s=0.002)
    hw = make_hardware(cpu_optim_params_per_s=2e9)
    stalled = _stalled(true)
    plan = SearchRequest({stalled.chunk_size: stalled}, hw, 1600 * MiB).plan()

    def step_of(profile: ModelProfile) -> float:
        return _step(profile, hw, plan)

    measured = step_of(true)
    assert calibrate_compute_cap(stalled, step_of, measured) == pytest.approx(true.post.fwd_s)
    assert calibrate_compute_cap(true, step_of, 0.5 * measured) is None
    blocks = tuple(replace(b, fwd_s=b.fwd_s + STALL_S) for b in true.blocks)
    assert calibrate_compute_cap(replace(stalled, blocks=blocks), step_of, measured) is None
    floor = step_of(stalled.with_outliers_capped(measured, 0.0))
    assert calibrate_compute_cap(stalled, step_of, floor * (1 - 2 * COMPUTE_SCALE_FIT)) is None


def test_a_device_update_slower_or_faster_than_planned_replaces_the_planned_rate():
    """The user's optimizer measured updating the persistent chunks at ``step()`` far from the
    probed GPU rate: the rate is replaced (not the blocks' compute scaled to fit the step), the
    running plan's prediction is the measured step, and the log's words name both rates; within
    ``GPU_RATE_MARGIN`` nothing changes."""
    true_rate, probed = 60e9, 3e9
    profile = make_profile(n_blocks=8, fwd_s=0.005)
    hw = make_hardware(gpu_optim_params_per_s=probed)
    # Every chunk persistent (pinned): the update at step() is all the device's.
    n_chunks = len(profile.chunks)
    request = SearchRequest({profile.chunk_size: profile}, hw, None, {"n_persist": n_chunks})
    plan = request.plan()
    assert plan.n_persist == n_chunks, plan.summary()
    measured = _step(profile, replace(hw, gpu_optim_params_per_s=true_rate), plan)
    assert plan.predicted_step_s > 1.2 * measured, "the probed rate must matter to this step"
    found = calibrated(
        plan,
        request,
        profile,
        profile.chunk_size,
        Measured(plan.predicted_peak_bytes, step_s=measured, gpu_rate=true_rate),
    )
    assert found is not None
    assert found.request.hw.gpu_optim_params_per_s == true_rate
    assert "GPU update 60.0 Gparam/s measured vs 3.0 planned" in found.what, found.what
    assert "compute x" not in found.what, found.what
    assert found.profile.blocks == profile.blocks
    assert isinstance(found.outcome, Plan)
    assert found.outcome.predicted_step_s == pytest.approx(measured, rel=1e-6)
    close = probed * (1 + replan.GPU_RATE_MARGIN / 2)
    predicted = plan.predicted_step_s
    kept = calibrated(
        plan,
        request,
        profile,
        profile.chunk_size,
        Measured(plan.predicted_peak_bytes, step_s=predicted, gpu_rate=close),
    )
    assert kept is None
