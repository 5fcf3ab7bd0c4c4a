"""What a calibration check concludes from a window of planned steps: which of the plan's
assumptions the measurements contradict, the calibrated profile and hardware, and the plan the
search finds with them (or why none fits). Pure: the runtime measures
(``runtime/control/calibration.py``) and applies the outcome."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from autooffload.errors import PlanError
from autooffload.plan.calibration_model import (
    COMPUTE_ELASTICITY_MIN,
    COMPUTE_OUTLIER_BAND,
    LINK_ELASTICITY_MIN,
    calibrate,
    calibrate_compute,
    calibrate_compute_cap,
    calibrate_device,
    calibrate_link,
    elasticity_at_one,
    with_link_scaled,
)
from autooffload.plan.configuration import (
    with_accumulation_of,
    with_checkpoint_inputs_on_cpu,
    with_mlp_tiles,
)
from autooffload.plan.cost_time import predict_step_time
from autooffload.plan.profile_types import HardwareProfile, ModelProfile
from autooffload.plan.residency import chunk_tables
from autooffload.plan.search import SearchRequest
from autooffload.plan.types import Plan
from autooffload.plan.update_split import GPU_UPDATE_AUTO, GPU_UPDATE_OFF

# How far above the predicted peak the measured one may be, and how far from the planned rate
# the measured CPU update (or gradient adds), before the model is calibrated.
CALIBRATION_MARGIN = 0.02
CPU_RATE_MARGIN = 0.10
# How far from the planned rate the user's optimizer measured updating the persistent chunks
# on the device at ``step()`` before that rate is replaced.
GPU_RATE_MARGIN = 0.10
# The host copies' measured rates raise the probed ones by more than this.
COPY_RATE_MARGIN = 0.10
# How far the measured step time may be from the prediction (with the calibrated peak, CPU
# rate and copy rates) before the units' compute times are re-derived from it
# (``step_calibration``).
STEP_MARGIN = 0.05
# A settled plan's drift check acts beyond DRIFT_MARGIN. At any check the plan changes only
# where the calibrated search finds one faster than the running plan by REPLAN_GAIN, or where
# the running plan no longer fits, since a switch costs a synchronisation and the chunks' moves.
DRIFT_MARGIN = 0.10
REPLAN_GAIN = 0.05
# Unit times a compute cap cut that its log line names, the longest first.
CAPPED_NAMED = 3


@dataclass(frozen=True)
class Measured:
    """One window's measurements: the device memory it needed (bytes), the CPU worker's update
    and gradient-add rates (params/s), the median step (s), the chunk copies' H2D and D2H rates
    (bytes/s), the user's optimizer's rate on the device params at ``step()`` (params/s); None
    where unmeasured."""

    peak: int
    cpu_rate: float | None = None
    step_s: float | None = None
    copy_bps: tuple[float | None, float | None] | None = None
    accumulate_rate: float | None = None
    gpu_rate: float | None = None


@dataclass(frozen=True)
class Calibration:
    """What a calibration found and the search it ran: the new plan, or why none fits."""

    what: str
    profile: ModelProfile
    request: SearchRequest
    outcome: Plan | str
    drift: bool = False


def calibrated(
    plan: Plan,
    request: SearchRequest,
    profile: ModelProfile,
    chunk_size: int,
    measured: Measured,
    drift: bool = False,
) -> Calibration | None:
    """The calibrated profile and hardware, and the plan searched with them; None when the
    measurements are within the margins of what the plan assumed."""
    measured_peak, measured_cpu_rate = measured.peak, measured.cpu_rate
    measured_step_s, measured_copy_bps = measured.step_s, measured.copy_bps
    measured_accumulate_rate = measured.accumulate_rate
    predicted = plan.predicted_peak_bytes
    if not predicted:
        return None
    if drift and not drifted(plan, measured_peak, measured_step_s):
        return None
    gib = 1 << 30
    found = []
    calibrated, hw = profile, request.hw
    if measured_peak > predicted * (1 + CALIBRATION_MARGIN):
        old = profile.fragmentation_factor
        factor = calibrate(profile, measured_peak, predicted)
        calibrated = profile.with_fragmentation(factor)
        found.append(
            f"measured peak {measured_peak / gib:.2f} GiB > predicted {predicted / gib:.2f} GiB"
            f" (fragmentation {old:.3f} -> {factor:.3f})"
        )
    planned_rate = hw.cpu_optim_params_per_s
    if measured_cpu_rate and abs(measured_cpu_rate / planned_rate - 1) > CPU_RATE_MARGIN:
        hw = replace(hw, cpu_optim_params_per_s=measured_cpu_rate)
        found.append(
            f"CPU update {measured_cpu_rate / 1e9:.2f} Gparam/s measured vs"
            f" {planned_rate / 1e9:.2f} planned"
        )
    planned_gpu = hw.gpu_optim_params_per_s
    if measured.gpu_rate and abs(measured.gpu_rate / planned_gpu - 1) > GPU_RATE_MARGIN:
        hw = replace(hw, gpu_optim_params_per_s=measured.gpu_rate)
        found.append(
            f"GPU update {measured.gpu_rate / 1e9:.1f} Gparam/s measured vs"
            f" {planned_gpu / 1e9:.1f} planned"
        )
    planned_adds = hw.cpu_accumulate_params_per_s
    if measured_accumulate_rate and not (
        abs(measured_accumulate_rate / planned_adds - 1) <= CPU_RATE_MARGIN
    ):
        hw = replace(hw, cpu_accumulate_params_per_s=measured_accumulate_rate)
        found.append(
            f"gradient accumulation {measured_accumulate_rate / 1e9:.2f} Gparam/s measured vs"
            + (f" {planned_adds / 1e9:.2f} planned" if math.isfinite(planned_adds) else " none")
        )
    if measured_copy_bps is not None:
        raised = raised_copy_rates(hw, *measured_copy_bps)
        if raised is not None:
            hw, what = raised
            found.append(what)
    if measured_step_s:
        step = step_calibration(plan, calibrated, hw, measured_step_s)
        if step is not None:
            calibrated, hw, what = step
            found.append(what)
    if not found:
        return None
    new_request = SearchRequest(
        {calibrated.chunk_size: calibrated},
        hw,
        request.budget_bytes,
        request.fixed,
        # A drift check keeps the persistent chunks: without expandable segments the reserved
        # peak fills a hard cap whatever the plan, and each check would demote again.
        min_persist=plan.n_persist if drift else 0,
        checkpoint_inputs=request.checkpoint_inputs,
        host_input_blocks=request.host_input_blocks,
        host_room=request.host_room,
    )
    outcome: Plan | str
    try:
        outcome = replace(
            new_request.plan(),
            chunk_size=chunk_size,
            source=calibrated_source(plan.source),
        )
    except PlanError as error:
        outcome = str(error)
    # Every check, the first ones included: a window's CPU rate moves by 10-20% on a busy host,
    # and each such reading re-planned for a predicted gain under 2%, flipping one chunk between
    # the GPU and CPU updates and back (3.6B at 16 GiB: 398 -> 404 -> 411 -> 404 ms predicted).
    if isinstance(outcome, Plan) and not outcome.configures_like(plan):
        outcome = unless_faster(plan, outcome, new_request, chunk_size)
    return Calibration("; ".join(found), calibrated, new_request, outcome, drift)


def raised_copy_rates(
    hw: HardwareProfile, h2d: float | None, d2h: float | None
) -> tuple[HardwareProfile, str] | None:
    """``hw`` with its copy rates raised to the measured ones where those exceed them by more
    than COPY_RATE_MARGIN, and the log's words; None when neither does.

    The probe times one 256 MiB copy at attach; on a busy host it has read an H100's pinned
    H2D at 24 GB/s where the run's chunk copies then moved 42 GB/s (the plan predicted a
    PCIe-bound 639 ms step that ran in 452). A measured rate is taken beside the other
    direction's copies and the compute's traffic, so it can only be below the link's own: it
    raises the probed rate and never lowers it. The both-ways rate was probed in the same
    moment, so it is scaled by the larger of the two raises (capped at the sum of the one-way
    rates, and at least the larger of them)."""

    def raised(measured: float | None, probed: float) -> float:
        return measured if measured and measured > probed * (1 + COPY_RATE_MARGIN) else probed

    ways = (
        ("H2D", raised(h2d, hw.h2d_bps), hw.h2d_bps),
        ("D2H", raised(d2h, hw.d2h_bps), hw.d2h_bps),
    )
    words = [
        f"{name} {new / 1e9:.1f} GB/s measured vs {old / 1e9:.1f} probed"
        for name, new, old in ways
        if new != old
    ]
    if not words:
        return None
    (_, h2d_bps, _), (_, d2h_bps, _) = ways
    factor = max(new / old for _, new, old in ways)
    duplex = max(min(hw.duplex_bps * factor, h2d_bps + d2h_bps), h2d_bps, d2h_bps)
    return (
        replace(hw, h2d_bps=h2d_bps, d2h_bps=d2h_bps, duplex_bps=duplex),
        "host copies " + ", ".join(words),
    )


def calibrated_source(source: str) -> str:
    """The plan's source after a calibration (once, however many calibrations it had)."""
    return source if source.endswith(", calibrated") else f"{source}, calibrated"


def drifted(plan: Plan, measured_peak: int, measured_step_s: float | None) -> bool:
    """A settled plan's window measured a step off its prediction by more than
    ``DRIFT_MARGIN``, or a peak above it by more than ``CALIBRATION_MARGIN``."""
    if measured_peak > plan.predicted_peak_bytes * (1 + CALIBRATION_MARGIN):
        return True
    predicted = plan.predicted_step_s
    return bool(measured_step_s and predicted) and (
        abs(measured_step_s / predicted - 1) > DRIFT_MARGIN
    )


def unless_faster(plan: Plan, found: Plan, request: SearchRequest, chunk_size: int) -> Plan:
    """``found`` when the running ``plan``'s configuration (its knobs and its count of chunks
    updated on the GPU) no longer fits the calibrated model or ``found`` is predicted
    ``REPLAN_GAIN`` faster than it; else the running configuration with its calibrated
    prediction."""
    fixed = asdict(plan.knobs)
    profiles = {
        size: with_running_split(profile, plan)
        for size, profile in request.profiles_by_chunk_size.items()
    }
    try:
        stay = replace(request, profiles_by_chunk_size=profiles, fixed=fixed).plan()
    except PlanError:
        return found
    if found.predicted_step_s < stay.predicted_step_s * (1 - REPLAN_GAIN):
        return found
    return replace(stay, chunk_size=chunk_size, source=found.source)


def with_running_split(profile: ModelProfile, plan: Plan) -> ModelProfile:
    """``profile`` with the GPU update split the search picks on auto fixed at ``plan``'s count:
    the split follows the CPU rate, which a window reads 10-20% off on a busy host (3.6B at 16
    GiB: 3 -> 6 -> 5 chunks updated on the GPU in three checks). Gradient accumulation on
    auto stays where the plan sums (``configuration.with_accumulation_of``)."""
    profile = with_accumulation_of(profile, plan)
    if profile.update_in_backward:
        if profile.gpu_update_in_backward != GPU_UPDATE_AUTO:
            return profile
        k = plan.gpu_backward_chunks
        return replace(profile, gpu_update_in_backward=k if k else GPU_UPDATE_OFF)
    if profile.gpu_update != GPU_UPDATE_AUTO:
        return profile
    k = plan.gpu_update_chunks
    return replace(profile, gpu_update=k if k else GPU_UPDATE_OFF)


def step_calibration(
    plan: Plan, profile: ModelProfile, hw: HardwareProfile, measured_step_s: float
) -> tuple[ModelProfile, HardwareProfile, str] | None:
    """``profile`` with its compute re-derived from the measured step, or ``hw`` with its host
    link's rates, and the log's words for it; None when the step is within ``STEP_MARGIN`` of
    the prediction, or neither explains it.

    Unit times that outlast the whole measured step held a stall: they alone are cut to fit
    it (``calibration_model.calibrate_compute_cap``). Otherwise every unit's times are scaled
    by one factor (``calibrate_compute``): the step runs its blocks slower or faster than the
    probe timed them alone. Where the compute does not set the step (a change of it does not
    move the prediction enough), the host copies' times are scaled by one factor
    (``calibrate_link``): the step's copies run slower or faster than the probe's.

    A step slower than predicted where neither is elastic at the profiled times (several terms
    nearly tie: 10% more of any one moves the step by under half of that) is laid on the one
    that reaches the measurement elastically and moves the step more at 1; where neither does,
    on both by one factor (``calibrate_device``): under data parallelism the collectives hold
    SMs while the blocks run and share the host link while the chunks copy. 8B at 24 GiB on
    four H200s: predicted 635 ms, 924 measured (compute x1.73); on two: 740 and 942 (both
    x1.37); neither was calibrated before."""
    tables = chunk_tables(profile)

    def step_of(candidate: ModelProfile) -> float:
        return predict_step_time(running_variant(candidate, plan, hw), hw, plan.knobs, tables)[0]

    predicted = step_of(profile)
    if abs(measured_step_s / predicted - 1) <= STEP_MARGIN:
        return None
    missed = f"measured step {measured_step_s * 1e3:.0f} ms vs predicted {predicted * 1e3:.0f} ms"
    cap = calibrate_compute_cap(profile, step_of, measured_step_s)
    if cap is not None:
        return (
            profile.with_outliers_capped(measured_step_s, cap),
            hw,
            (
                f"{missed} (the profiled compute times were an outlier:"
                f" {outlasting_times(profile, measured_step_s)} outlasted the whole step;"
                f" capped at {cap * 1e3:.1f} ms)"
            ),
        )
    running = running_variant(profile, plan, hw)

    def on_compute(factor: float) -> tuple[ModelProfile, HardwareProfile, str]:
        low, high = COMPUTE_OUTLIER_BAND
        outlier = "" if low <= factor <= high else "; the profiled compute times were an outlier"
        return profile.with_compute_scaled(factor), hw, f"{missed} (compute x{factor:.2f}{outlier})"

    def on_link(factor: float) -> tuple[ModelProfile, HardwareProfile, str]:
        scaled = with_link_scaled(hw, factor)
        return (
            profile,
            scaled,
            f"{missed} (host copies x{factor:.2f} the probed time:"
            f" H2D {scaled.h2d_bps / 1e9:.1f}, D2H {scaled.d2h_bps / 1e9:.1f} GB/s)",
        )

    def step_on(link_hw: HardwareProfile) -> float:
        variant = running_variant(profile, plan, link_hw)
        return predict_step_time(variant, link_hw, plan.knobs, tables)[0]

    def step_computing(factor: float) -> float:
        return predict_step_time(running.with_compute_scaled(factor), hw, plan.knobs, tables)[0]

    # Each factor fitted (the test on the fitted change only), and how much of a change of it
    # shows in the step at the profiled times; the fit counts at once where that is elastic.
    candidates = [
        (
            calibrate_compute(running, hw, plan.knobs, measured_step_s, at_one=False),
            elasticity_at_one(step_computing),
            COMPUTE_ELASTICITY_MIN,
            on_compute,
        ),
        (
            calibrate_link(hw, step_on, measured_step_s, at_one=False),
            elasticity_at_one(lambda f: step_on(with_link_scaled(hw, f))),
            LINK_ELASTICITY_MIN,
            on_link,
        ),
    ]
    fitted = [candidate for candidate in candidates if candidate[0] is not None]
    for found, elastic, least, then in fitted:
        if elastic >= least:
            return then(found)
    if measured_step_s < predicted:
        return None
    # A slower step whose terms nearly tie at the profiled times: neither is elastic at 1.
    # Of those that reach the measurement elastically, the one that moves the step more at 1.
    if fitted:
        found, _, _, then = max(fitted, key=lambda candidate: candidate[1])
        return then(found)

    def step_both(factor: float) -> float:
        link_hw = with_link_scaled(hw, factor)
        variant = running_variant(profile.with_compute_scaled(factor), plan, link_hw)
        return predict_step_time(variant, link_hw, plan.knobs, tables)[0]

    both = calibrate_device(step_both, measured_step_s)
    if both is None:
        return None
    return (
        profile.with_compute_scaled(both),
        with_link_scaled(hw, both),
        f"{missed} (compute and host copies x{both:.2f})",
    )


def running_variant(profile: ModelProfile, plan: Plan, hw: HardwareProfile) -> ModelProfile:
    """``profile`` as ``plan`` runs it: its checkpointed blocks may keep their inputs in host
    memory, its MLPs may run in tiles, and its GPU update split stays at the running count (on
    auto it would follow a new CPU rate to another split, and the running step would be judged
    against that split's prediction)."""
    variant = with_running_split(profile, plan)
    if plan.mlp_tile_tokens:
        variant = with_mlp_tiles(variant, plan.mlp_tile_tokens)
    if "checkpoint_cpu" in plan.block_policies:
        variant = with_checkpoint_inputs_on_cpu(variant, hw, plan.host_input_blocks or None)
    return variant


def outlasting_times(profile: ModelProfile, step_s: float) -> str:
    """The log's words for the unit times longer than ``step_s``: "post forward 1453 ms", the
    longest ``CAPPED_NAMED`` of them and how many more."""
    times = sorted(
        (
            (seconds, f"{unit.name or f'unit {index}'} {phase}")
            for index, unit in enumerate(profile.units)
            for phase, seconds in (("forward", unit.fwd_s), ("backward", unit.bwd_s))
            if seconds > step_s
        ),
        reverse=True,
    )
    words = ", ".join(f"{name} {seconds * 1e3:.0f} ms" for seconds, name in times[:CAPPED_NAMED])
    more = len(times) - CAPPED_NAMED
    return words + (f" and {more} more" if more > 0 else "")
