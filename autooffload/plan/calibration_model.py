"""Calibration of the cost model from a measured step: fragmentation factor, compute scale,
compute cap, host link scale, and both scales together."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from autooffload.errors import PlanError
from autooffload.plan.cost_time import predict_step_time
from autooffload.plan.profile_types import HardwareProfile, ModelProfile
from autooffload.plan.residency import chunk_tables
from autooffload.plan.types import Knobs


def calibrate(
    model_profile: ModelProfile,
    measured_peak: int,
    predicted_peak: int,
    cuda_context_bytes: int = 0,
) -> float:
    """New fragmentation factor for ``model_profile.weight_dtype`` from one measured step.

    Both peaks include the CUDA context (``cuda_context_bytes``, from the HardwareProfile used):
        allocated = (predicted - context) / f_old
        f_new     = max(1, (measured - context) / allocated)
    Use it with ``model_profile.with_fragmentation(f_new)`` and re-plan.
    """
    old = model_profile.fragmentation_factor
    predicted_alloc = (predicted_peak - cuda_context_bytes) / old
    if predicted_alloc <= 0:
        raise PlanError(
            f"predicted_peak={predicted_peak} is not above cuda_context_bytes={cuda_context_bytes};"
            " pass the peak predict_peak_bytes returned and the same context bytes"
        )
    return max(1.0, (measured_peak - cuda_context_bytes) / predicted_alloc)


# ``calibrate_compute``: the range of the compute factor, and how close the scaled prediction
# must come to the measured step for the factor to count as the explanation of the miss. Down to
# 1/16: a probe disturbed by other work throughout times every block several times slower than
# the step runs it; the elasticity tests below keep a floor compute does not set from passing.
COMPUTE_SCALE_RANGE = (1 / 16, 4.0)
# Factors outside this band mean the profile's compute times were an outlier (said so in the log).
COMPUTE_OUTLIER_BAND = (0.5, 2.0)
COMPUTE_SCALE_FIT = 0.02
# The least share of a change in compute time that must show in the predicted step (its
# elasticity at the profiled times) for a step miss to be laid on compute at all.
COMPUTE_ELASTICITY_MIN = 0.5
# ``calibrate_compute_cap``: the units whose times outlast the step must be fewer than this share
# of them. A one-off stall lands in the span it happened in; most units' is no stall.
COMPUTE_CAP_MAX_SHARE = 0.5
# ``calibrate_link``: the range of the factor on the host link's copy times (the copy rates are
# divided by it), and the least share of a change in copy time that must show in the step.
LINK_SCALE_RANGE = (1 / 4, 4.0)
LINK_ELASTICITY_MIN = 0.5
_BISECTIONS = 40


def calibrate_compute(
    profile: ModelProfile,
    hw: HardwareProfile,
    knobs: Knobs,
    measured_step_s: float,
    at_one: bool = True,
) -> float | None:
    """The factor f by which the units' compute times must be scaled
    (``profile.with_compute_scaled(f)``) for ``predict_step_time`` at ``knobs`` to equal a
    measured step, or None when compute is not what the step is made of or no f in
    ``COMPUTE_SCALE_RANGE`` brings the prediction within ``COMPUTE_SCALE_FIT`` of it.

    Compute must be most of the step: a 10% change of every unit's time must change the
    predicted step by at least ``COMPUTE_ELASTICITY_MIN`` x 10%, and so must the fitted change
    (the step moves by at least ``COMPUTE_ELASTICITY_MIN`` x |f - 1|). A step bound by the CPU
    update (3.6B at 16 GiB: elasticity ~0.3) that misses by 13% would otherwise be "explained" by
    halving every block's time, and the search would then trade memory for recompute it
    thinks is cheap; that miss is the CPU update's, whose rate is calibrated on its own.

    The probe times each block alone; in the step the same blocks run beside the CPU update's
    threads, the copies and the other launching thread, and a launch-bound block (a small
    model at a short batch) runs slower there than alone. The step time is non-decreasing in f
    (every window is a max of terms, each non-decreasing in compute), so the smallest f whose
    prediction reaches the measurement is found by bisection.
    """
    tables = chunk_tables(profile)

    def predicted(factor: float) -> float:
        return predict_step_time(profile.with_compute_scaled(factor), hw, knobs, tables)[0]

    return fitted_scale(
        predicted, measured_step_s, COMPUTE_SCALE_RANGE, COMPUTE_ELASTICITY_MIN, at_one
    )


def calibrate_compute_cap(
    profile: ModelProfile, step_of: Callable[[ModelProfile], float], measured_step_s: float
) -> float | None:
    """The time c (seconds, at most the measured step) to which the units' forward and
    backward times that outlast a measured step are cut
    (``profile.with_outliers_capped(measured_step_s, c)``) for ``step_of``, the predicted step
    of a profile, to equal the measurement; None where no time outlasts it, where those that do
    are in ``COMPUTE_CAP_MAX_SHARE`` of the units or more, or where no c brings the prediction
    within ``COMPUTE_SCALE_FIT`` of the measurement.

    No unit can take longer than a whole step. The pre and post units are spans of the
    profiling step's own timeline, timed once; a stall there (a lazy initialisation, the host
    busy between the forward and the backward) makes one unit outlast the step while the others
    are right (3.6B: ~1.45 s of post forward, a step of 412 ms). One factor on every unit
    cannot take the stall out without making the right units many times too fast, and on a step
    bound by the copies or the CPU update it cannot reach the measurement at all; a cap takes it
    out where it is and leaves the other times as profiled.

    As for ``calibrate_compute``, the step must move by at least ``COMPUTE_ELASTICITY_MIN`` of
    the compute the cap removes. The step time is non-decreasing in c, so the smallest c whose
    prediction reaches the measurement is found by bisection.
    """
    if measured_step_s <= 0:
        raise PlanError(f"measured_step_s={measured_step_s} must be > 0 seconds")
    units = profile.units
    outlasting = sum(max(u.fwd_s, u.bwd_s) > measured_step_s for u in units)
    if not outlasting or outlasting >= COMPUTE_CAP_MAX_SHARE * len(units):
        return None

    def capped(cap: float) -> ModelProfile:
        return profile.with_outliers_capped(measured_step_s, cap)

    low, high = 0.0, measured_step_s
    if step_of(capped(low)) < measured_step_s:
        for _ in range(_BISECTIONS):
            middle = (low + high) / 2
            if step_of(capped(middle)) < measured_step_s:
                low = middle
            else:
                high = middle
        low = high
    fitted = step_of(capped(low))
    if abs(fitted / measured_step_s - 1) > COMPUTE_SCALE_FIT:
        return None
    removed = _compute_s(profile) - _compute_s(capped(low))
    if step_of(profile) - fitted < COMPUTE_ELASTICITY_MIN * removed:
        return None
    return low


def _compute_s(profile: ModelProfile) -> float:
    """Seconds of the units' forward and backward compute, recompute aside."""
    return sum(u.fwd_s + u.bwd_s for u in profile.units)


def with_link_scaled(hw: HardwareProfile, factor: float) -> HardwareProfile:
    """``hw`` with every host copy taking ``factor`` times as long: its H2D, D2H and both-ways
    rates divided by ``factor``."""
    return replace(
        hw,
        h2d_bps=hw.h2d_bps / factor,
        d2h_bps=hw.d2h_bps / factor,
        duplex_bps=hw.duplex_bps / factor,
    )


def calibrate_link(
    hw: HardwareProfile,
    step_of: Callable[[HardwareProfile], float],
    measured_step_s: float,
    at_one: bool = True,
) -> float | None:
    """The factor g by which the host copies' times must be scaled (``with_link_scaled(hw,
    g)``) for ``step_of``, the predicted step on a hardware profile, to equal a measured step
    (the copies a plan bakes into unit times, checkpoint inputs kept on the host, follow the
    rates there), or None when the
    copies are not what the step is made of or no g in ``LINK_SCALE_RANGE`` brings the
    prediction within ``COMPUTE_SCALE_FIT`` of it.

    For a step the model finds bound by the host link, where ``calibrate_compute`` declines (a
    change of compute does not move the step). The attach probe times each direction alone
    and then all local ranks copying at once; in the step the copies share the link and the
    host's memory with the CPU update, the other direction, gradient reduces and (under data
    parallelism) the owners' copies that the other ranks' broadcasts wait for. 8B at 24 GiB on
    four H200s: predicted 680 ms bound by D2H, 920 ms measured, and no calibration said so. The
    measured copy rates (``replan.raised_copy_rates``) only raise the probe: a copy's own rate
    is not what its wait costs the step. As for compute, the step must move by at least
    ``LINK_ELASTICITY_MIN`` of the copies' relative change, at 1 and over the fitted change.
    The step time is non-decreasing in g, so the smallest g whose prediction reaches the
    measurement is found by bisection.
    """

    def predicted(factor: float) -> float:
        return step_of(with_link_scaled(hw, factor))

    return fitted_scale(predicted, measured_step_s, LINK_SCALE_RANGE, LINK_ELASTICITY_MIN, at_one)


def calibrate_device(step_of: Callable[[float], float], measured_step_s: float) -> float | None:
    """The factor h by which the units' compute and the host copies' times must both be scaled
    for ``step_of`` (the predicted step with both scaled by a factor) to equal a slower
    measured step, or None when no h in ``LINK_SCALE_RANGE`` brings the prediction within
    ``COMPUTE_SCALE_FIT`` of it or the fitted change moves the step by less than
    ``LINK_ELASTICITY_MIN`` of its own.

    For a miss that neither explains alone: under data parallelism the ranks' collectives hold
    SMs while the blocks run and share the host's link and memory while the chunks copy, so
    both run slower than the probe timed them alone. 8B at 24 GiB on two H200s: predicted 740
    ms, 942 measured; compute alone (x1.65) and the copies alone (x1.6) each moved the step by
    under half of their change."""
    return fitted_scale(
        step_of, measured_step_s, LINK_SCALE_RANGE, LINK_ELASTICITY_MIN, at_one=False
    )


def elasticity_at_one(predicted: Callable[[float], float]) -> float:
    """The share of a 10% change of a factor that shows in ``predicted``, the step at that
    factor: 1 where the factor alone sets the step, 0 where it does not move it."""
    base = predicted(1.0)
    return (predicted(1.1) - base) / (0.1 * base)


def fitted_scale(
    predicted: Callable[[float], float],
    measured_step_s: float,
    scale_range: tuple[float, float],
    elasticity_min: float,
    at_one: bool = True,
) -> float | None:
    """The smallest factor in ``scale_range`` whose ``predicted`` step (non-decreasing in the
    factor) reaches ``measured_step_s``, found by bisection; None when the step is not made of
    what the factor scales or no factor brings the prediction within ``COMPUTE_SCALE_FIT``.

    The step must be elastic: 10% more must lengthen the predicted step by at least
    ``elasticity_min`` x 10% at 1, and the fitted change must move it by at least
    ``elasticity_min`` of the factor's own change. A step elastic at 1 can flatten onto a floor
    the factor does not set (the CPU update, the copies) further down: 3.6B at 24 GiB measured
    15% below its prediction was "explained" by compute x0.25, and the re-plan on that profile
    predicted 153 ms for a plan that ran 273. ``at_one=False`` leaves out the test at 1, for a
    slower step whose terms nearly tie there (``replan.step_calibration``)."""
    if measured_step_s <= 0:
        raise PlanError(f"measured_step_s={measured_step_s} must be > 0 seconds")
    base = predicted(1.0)
    if at_one and elasticity_at_one(predicted) < elasticity_min:
        return None
    low, high = scale_range
    if predicted(high) < measured_step_s:
        low = high
    elif predicted(low) < measured_step_s:
        for _ in range(_BISECTIONS):
            middle = (low * high) ** 0.5
            if predicted(middle) < measured_step_s:
                low = middle
            else:
                high = middle
        low = high
    fitted = predicted(low)
    if abs(fitted / measured_step_s - 1) > COMPUTE_SCALE_FIT:
        return None
    if abs(fitted - base) < elasticity_min * abs(low - 1.0) * base:
        return None
    return low
