"""Calibration after the plan switch: the planned steps' measured peak and CPU update rate
against what the plan assumed, and the one re-plan that follows when they differ."""

from __future__ import annotations

import math
import statistics
import time
from typing import TYPE_CHECKING, Any

import torch

from autooffload.log import logger, warn_once
from autooffload.plan.profile_types import need_from_peaks
from autooffload.plan.replan import Calibration, Measured, calibrated
from autooffload.plan.types import Plan
from autooffload.runtime import registry

if TYPE_CHECKING:
    from autooffload.runtime.runtime import Runtime
    from autooffload.runtime.update.cpu_optimizer import CpuOptimizer

# Steps run under the searched plan before its measured peak and CPU update rate are compared
# with what the plan assumed (the margins are ``plan/replan.py``'s) ...
CALIBRATE_AFTER_STEPS = 5
# ... or fewer where the plan's predicted steps fill CALIBRATE_WINDOW_S sooner: a long sequence's
# step takes seconds to minutes and measures steadily in one (Llama-3-8B LoRA at seq 32768:
# 6.4 s), and five of them before the timed steps would cost minutes. Never fewer than
# MIN_CALIBRATE_STEPS: the switch step, which is not timed, and one timed step.
CALIBRATE_WINDOW_S = 10.0
MIN_CALIBRATE_STEPS = 2
# A window with less than COPY_RATE_MIN_BYTES copied one way does not measure that way.
COPY_RATE_MIN_BYTES = 1 << 30
# A calibration that switches the plan checks the new plan the same way, CALIBRATE_AFTER_STEPS
# later (the new plan's prediction is otherwise never measured: a swap-heavy re-plan ran 23%
# slower than predicted); at most CALIBRATION_ROUNDS switches in a row, then the plan settles.
CALIBRATION_ROUNDS = 3
# Once settled, every DRIFT_WINDOW_STEPS steps the window's median step is compared with the
# prediction: the host drifts within a run (the CPU update 2.6 -> 3.9 Gparam/s over 20 steps).
# Beyond ``replan.DRIFT_MARGIN`` the model is calibrated again.
DRIFT_WINDOW_STEPS = 50


def calibrate_after(plan: Plan) -> int:
    """Steps from a searched ``plan``'s switch to its check: ``CALIBRATE_AFTER_STEPS``, or as
    many predicted steps as fill ``CALIBRATE_WINDOW_S``, at least ``MIN_CALIBRATE_STEPS``."""
    step_s = plan.predicted_step_s
    if not step_s or step_s <= 0:
        return CALIBRATE_AFTER_STEPS
    window = math.ceil(CALIBRATE_WINDOW_S / step_s)
    return max(MIN_CALIBRATE_STEPS, min(CALIBRATE_AFTER_STEPS, window))


class StepTimer:
    """The planned steps' times, from one ``optimizer.step()`` to the next: CUDA events on the
    compute stream (the GPU's timeline, which a host running ahead does not shorten), host
    clock readings on a CPU device. Started at the plan switch for that plan. The cost model
    times a step of the profiled step's micro-batches (``ModelProfile.micro_batches``): a step
    with another count of backward passes leaves the timer without a measurement."""

    def __init__(self, plan: Plan, cuda: bool, micro_batches: int = 1) -> None:
        self.plan = plan
        self.cuda = cuda
        self.micro_batches = micro_batches
        self.marks: list[Any] = []
        self.as_profiled = True

    def mark(self, backwards: int) -> None:
        """At an ``optimizer.step()`` of a step that ran ``backwards`` backward passes."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())
        # The first mark closes the switch step (its forward ran the switch): not timed.
        if len(self.marks) > 1:
            self.as_profiled &= backwards == self.micro_batches

    def median_step_s(self, plan: Plan) -> float | None:
        """Median seconds per step between the marks (steps of one plan vary by 20-40% on a
        launch-bound model: a mean of a few is moved by one slow step), or None with fewer than
        two marks, a step of another count of backwards than the profiled one, or another plan
        than the one timed (an OOM retry's)."""
        if len(self.marks) < 2 or not self.as_profiled or plan is not self.plan:
            return None
        if self.cuda:
            self.marks[-1].synchronize()
            spans = [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        else:
            spans = [b - a for a, b in zip(self.marks, self.marks[1:])]
        return statistics.median(spans)


class DeviceUpdateTimer:
    """The user's optimizer steps of the params it updates on the device at ``step()`` (the
    persistent chunks', which the cost model charges at ``HardwareProfile.gpu_optim_params_per_s``),
    or in the backward under the update in the backward (``BackwardUpdates.update_persistent``):
    how long each took and how many params it updated. CUDA events on the current stream (the
    device's own time for the update's kernels), host clock readings on a CPU device. The
    attach-time probe times one tensor alone, and is not steady: on H200s it read 9-20 Gparam/s
    in one-rank runs and 49-97 in most multi-rank ones (bf16 AdamW, fused); where it reads low,
    persistent chunks look costly to the search and the step is predicted long (3.2B at 24 GiB:
    370 ms predicted, 307 measured)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.spans: list[tuple[Any, Any, int]] = []
        self._open: tuple[Any, int] | None = None

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self, numel: int) -> None:
        """Before the user's optimizer steps ``numel`` params on the device (0: nothing to time)."""
        self._open = (self._now(), numel) if numel > 0 else None

    def stop(self, applied: bool) -> None:
        """After that step; a step that did not apply its update (``applied`` False: a
        GradScaler's skipped step) is not counted."""
        if self._open is None:
            return
        (start, numel), self._open = self._open, None
        if applied:
            self.spans.append((start, self._now(), numel))

    def rate(self) -> float | None:
        """Params updated per second of the timed steps, or None with none timed."""
        if not self.spans:
            return None
        if self.cuda:
            self.spans[-1][1].synchronize()
            seconds = sum(a.elapsed_time(b) / 1e3 for a, b, _ in self.spans)
        else:
            seconds = sum(b - a for a, b, _ in self.spans)
        numel = sum(n for _, _, n in self.spans)
        return numel / seconds if seconds > 0 else None


def device_update_numel(optimizer: torch.optim.Optimizer) -> int:
    """Params ``optimizer`` is about to update on the device: those with a gradient (an
    offloaded param's ``.grad`` is None, its update is the CPU worker's)."""
    return sum(
        p.numel() for group in optimizer.param_groups for p in group["params"] if p.grad is not None
    )


# The CPU worker's counters at a mark (``CpuOptimizer.mark``): busy seconds, params updated,
# seconds adding gradients, gradient elements added.
WorkerMark = tuple[float, int, float, int]
NO_WORKER_MARK: WorkerMark = (0.0, 0, 0.0, 0)


class CalibrationSchedule:
    """When the running plan is next checked against its measured steps (``check``), and the
    window's timer and copy counters. Armed at a plan switch on a CUDA device; a check that
    switched the plan checks the new one CALIBRATE_AFTER_STEPS on (up to CALIBRATION_ROUNDS
    switches in a row); a plan that stays is settled and checked every DRIFT_WINDOW_STEPS."""

    def __init__(self) -> None:
        self._at_step: int | None = None
        self._settled = False
        self._switches = 0
        self._timer: StepTimer | None = None
        self._device_update: DeviceUpdateTimer | None = None
        self._copy_mark: tuple[float, float, float, float] | None = None

    @property
    def at_step(self) -> int | None:
        """The step after which the next check runs (None: not armed)."""
        return self._at_step

    @property
    def settled(self) -> bool:
        """Not armed, or past the first checks of the running plan (drift checks only)."""
        return self._at_step is None or self._settled

    @property
    def timer(self) -> StepTimer | None:
        return self._timer

    @property
    def copy_mark(self) -> tuple[float, float, float, float] | None:
        return self._copy_mark

    def due(self, steps_taken: int) -> bool:
        return steps_taken == self._at_step

    def mark_step(self, backwards: int) -> None:
        """At an ``optimizer.step()`` of a step that ran ``backwards`` backward passes."""
        if self._timer is not None:
            self._timer.mark(backwards)

    def device_update_starts(self, optimizer: torch.optim.Optimizer) -> None:
        """The user's ``optimizer`` is about to step: time its update of the device params."""
        if self._device_update is not None:
            self._device_update.start(device_update_numel(optimizer))

    def device_update_ends(self, applied: bool) -> None:
        """The user's optimizer stepped (``applied``: its update was not skipped)."""
        if self._device_update is not None:
            self._device_update.stop(applied)

    @property
    def device_update(self) -> DeviceUpdateTimer | None:
        """This window's timer of the user's device updates (None: not armed)."""
        return self._device_update

    def arm(self, runtime: Runtime, plan: Plan, after: int | None = None) -> None:
        """A searched ``plan`` starts to run: its first check comes ``after`` steps on (None:
        ``calibrate_after(plan)``), its
        steps are timed, its peak measured from here (``fresh_peak``) and the CPU worker's
        rate from this mark (the worker is idle: whoever switched waited for it)."""
        if runtime.manager.is_cuda:
            fresh_peak(runtime.device)
        self._switches = 0
        self._settled = False
        self._start_window(runtime, plan, calibrate_after(plan) if after is None else after)

    def _start_window(self, runtime: Runtime, plan: Plan, steps: int) -> None:
        self._at_step = runtime.steps_taken + steps
        self._timer = StepTimer(
            plan, cuda=runtime.manager.is_cuda, micro_batches=_micro_batches(runtime)
        )
        self._device_update = DeviceUpdateTimer(cuda=runtime.manager.is_cuda)
        runtime.cpu_optim.in_backward.device_timer = self._device_update
        runtime.control.mark_worker()
        self._copy_mark = copy_mark(runtime)

    def check(self, runtime: Runtime) -> Plan | None:
        """Calibrate on the steps since the last check, and set the next one. Every rank calls
        this at the same step (a collective under data parallelism). Returns the plan switched
        to, or None."""
        timer = self._timer
        runtime.cpu_optim.wait()  # this step's update belongs to the measured window
        # Rates over this rank's own chunks; under sharded state the cost model's are per model.
        sharding = runtime.manager.sharding

        def per_model(rate: float | None) -> float | None:
            return sharding.model_rate(rate) if sharding is not None and rate else rate

        mark = runtime.control.worker_mark
        new_plan = calibrate_after_steps(
            runtime,
            measured_need(runtime),
            per_model(worker_rate(mark, runtime.cpu_optim)),
            timer.median_step_s(runtime.plan) if timer is not None else None,
            drift=self._settled,
            measured_copy_bps=copy_rates(self._copy_mark, runtime),
            measured_accumulate_rate=per_model(accumulate_rate(mark, runtime.cpu_optim)),
            measured_gpu_rate=self._device_update.rate() if self._device_update else None,
        )
        self._switches = self._switches + 1 if new_plan is not None else 0
        self._settled = new_plan is None or self._switches >= CALIBRATION_ROUNDS
        window = DRIFT_WINDOW_STEPS if self._settled else calibrate_after(runtime.plan)
        self._start_window(runtime, runtime.plan, window)
        return new_plan


def _micro_batches(runtime: Runtime) -> int:
    """Backward passes per step of the profile the running plan was searched on."""
    return runtime.profile.micro_batches if runtime.profile is not None else 1


def measured_need(runtime: Runtime) -> int:
    """The device memory the steps since the last check needed (``profile_types.need_from_peaks``:
    under expandable segments the allocated peak with the allocator's prior, not the reserved
    peak, which runs to the cap whatever the plan needs; calibrating on it demoted chunks that
    fitted)."""
    device = runtime.device
    expandable = runtime.profile is not None and runtime.profile.expandable_segments
    need = need_from_peaks(
        torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device), expandable
    )
    return math.ceil(need)


def fresh_peak(device: torch.device) -> None:
    """Start measuring a new plan's peak: give the allocator's cached blocks back, then reset
    the peak counters. Without the ``empty_cache`` the reserved peak keeps what the previous
    plan (the profiling steps, or the plan before a calibration) left cached, and reads as the
    new plan's: the calibration then inflated the fragmentation factor, and a plan that fitted
    was measured at the cap. Once per plan switch (``cudaFree`` synchronizes the device)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)


def worker_rate(mark: WorkerMark, optimizer: CpuOptimizer) -> float | None:
    """Offloaded params updated per second the CPU worker was busy since ``mark`` (its
    ``optimizer.mark()`` then): each step's first copy of the gradients out of staging
    included, as the step runs it; the adds of further micro-batches, and under accumulation
    the copy of aliased gradients out of their staging, are not (``accumulate_rate``, costed
    apart). The worker must be idle at ``mark`` and now (``wait()`` first)."""
    busy_s, updated, add_s, _ = optimizer.mark()
    seconds, params = (busy_s - mark[0]) - (add_s - mark[2]), updated - mark[1]
    return params / seconds if seconds > 0 and params > 0 else None


def accumulate_rate(mark: WorkerMark, optimizer: CpuOptimizer) -> float | None:
    """Gradient elements the CPU worker added (or copied out of an aliased staging) per second
    of that work since ``mark`` (gradient accumulation's later micro-batches), or None where it
    did none."""
    _, _, add_s, added = optimizer.mark()
    seconds, params = add_s - mark[2], added - mark[3]
    return params / seconds if seconds > 0 and params > 0 else None


def copy_mark(runtime: Runtime) -> tuple[float, float, float, float]:
    """The manager's copy counters now: (H2D bytes, H2D seconds, D2H bytes, D2H seconds), the
    seconds those of the copies' CUDA events that finished (``fold_copy_times``)."""
    manager = runtime.manager
    manager.fold_copy_times(wait=manager.is_cuda)
    stats = manager.stats
    return (
        float(stats["h2d_bytes"]),
        float(stats["h2d_s"]),
        float(stats["d2h_bytes"]),
        float(stats["d2h_s"]),
    )


def copy_rates(
    mark: tuple[float, float, float, float] | None, runtime: Runtime
) -> tuple[float | None, float | None] | None:
    """The chunk copies' bytes per second of copy time since ``mark`` (``copy_mark``), H2D
    and D2H; None for a direction that copied less than COPY_RATE_MIN_BYTES, and None on a
    CPU device (its copies are not timed). Each is the rate the copies ran at beside the other
    direction's and the compute's traffic: no more than the link's own rate in that direction."""
    if mark is None or not runtime.manager.is_cuda:
        return None
    now = copy_mark(runtime)

    def rate(moved: float, seconds: float) -> float | None:
        return moved / seconds if moved >= COPY_RATE_MIN_BYTES and seconds > 0 else None

    return rate(now[0] - mark[0], now[1] - mark[1]), rate(now[2] - mark[2], now[3] - mark[3])


def calibrate_after_steps(
    runtime: Runtime,
    measured_peak: int,
    measured_cpu_rate: float | None = None,
    measured_step_s: float | None = None,
    drift: bool = False,
    measured_copy_bps: tuple[float | None, float | None] | None = None,
    measured_accumulate_rate: float | None = None,
    measured_gpu_rate: float | None = None,
) -> Plan | None:
    """Check the planned steps against what their plan assumed, in this order:
    - the measured peak (``measured_need``) above the prediction by more than
      ``CALIBRATION_MARGIN`` calibrates the fragmentation factor (``calibration_model.calibrate``);
    - the CPU worker's measured rate (``worker_rate``: the update contended by the running step,
      gradient accumulation included) off the planned one by more than ``CPU_RATE_MARGIN``
      replaces it;
    - the user's optimizer's measured rate on the device params at ``step()``
      (``DeviceUpdateTimer``) off the planned GPU update rate by more than ``GPU_RATE_MARGIN``
      replaces it;
    - gradient accumulation: the worker's measured rate of adds (``accumulate_rate``) off the
      planned one by more than ``CPU_RATE_MARGIN`` (or none planned) replaces it;
    - the chunk copies' measured H2D and D2H rates (``copy_rates``) above the probed ones by
      more than ``COPY_RATE_MARGIN`` raise them (``replan.raised_copy_rates``): a copy that ran that
      fast beside the other traffic shows the probe read the link low;
    - the measured step time (``StepTimer``) off the plan's step as predicted with the
      calibrations above (at the plan's own GPU update split) by more than ``STEP_MARGIN``
      re-derives the units' compute times (``replan.step_calibration``): unit times that
      outlast the whole step (a stall in a profiled span) are cut to fit it, else every unit's
      times are scaled, when a scale explains it, else the host copies' rates are, when the
      copies set the step.
    Any of them re-runs the search, which may promote chunks or demote them (their optimizer
    state moves between the user's optimizer and the CPU twins: ``Runtime.apply_plan``); a
    ``drift`` check only promotes.
    Returns the new plan, or None when the assumptions held or
    the plan stays. Logged once whenever it acts.

    Every check switches only to a plan predicted ``REPLAN_GAIN`` faster than the running one
    under the calibrated model, unless the running one no longer fits (``replan.unless_faster``).

    ``drift``: a settled plan's periodic check (``CalibrationSchedule.check``). It acts only on
    a step off the prediction by more than ``DRIFT_MARGIN`` (or a peak over it), keeps the
    persistent chunks, and logs at debug level when the plan stays.

    Under data parallelism every rank calls this at the same step (a collective): the ranks
    judge the largest peak, the slowest CPU update and the slowest step of any rank, and all
    take rank 0's outcome, as they take rank 0's plan at the switch, so their collectives stay
    in step."""
    dp = runtime.data_parallel
    if dp is not None:
        measured = dp.gather_object(
            (
                int(measured_peak),
                measured_cpu_rate,
                measured_step_s,
                measured_copy_bps,
                measured_accumulate_rate,
                measured_gpu_rate,
            )
        )
        peaks, cpu_rates, steps, copies, adds, gpu_rates = zip(*measured)
        measured_peak = max(peaks)
        rates = [rate for rate in cpu_rates if rate]
        measured_cpu_rate = min(rates) if rates else None
        add_rates = [rate for rate in adds if rate]
        measured_accumulate_rate = min(add_rates) if add_rates else None
        device_rates = [rate for rate in gpu_rates if rate]
        measured_gpu_rate = min(device_rates) if device_rates else None
        measured_step_s = max(steps) if all(steps) else None
        # Each rank's link raises the plan only as far as the slowest rank's copies show.
        measured_copy_bps = None
        if all(copies):
            measured_copy_bps = tuple(  # type: ignore[assignment]
                None if None in way else min(way) for way in zip(*copies)
            )
    decision: Calibration | None = None
    if dp is None or dp.rank == 0:
        decision = _calibration(
            runtime,
            measured_peak,
            measured_cpu_rate,
            measured_step_s,
            drift,
            measured_copy_bps,
            measured_accumulate_rate,
            measured_gpu_rate,
        )
    if dp is not None:
        decision = dp.agree_object(decision)
    return None if decision is None else _apply_calibration(runtime, decision)


def _calibration(
    runtime: Runtime,
    measured_peak: int,
    measured_cpu_rate: float | None,
    measured_step_s: float | None = None,
    drift: bool = False,
    measured_copy_bps: tuple[float | None, float | None] | None = None,
    measured_accumulate_rate: float | None = None,
    measured_gpu_rate: float | None = None,
) -> Calibration | None:
    """The running plan's calibration from this window's measurements (``replan.calibrated``)."""
    request, profile = runtime.search_request, runtime.profile
    if request is None or profile is None:
        return None
    return calibrated(
        runtime.plan,
        request,
        profile,
        runtime.layout.chunk_size,
        Measured(
            measured_peak,
            measured_cpu_rate,
            measured_step_s,
            measured_copy_bps,
            measured_accumulate_rate,
            measured_gpu_rate,
        ),
        drift,
    )


def _apply_calibration(runtime: Runtime, found: Calibration) -> Plan | None:
    """Take the calibrated profile, and the new plan when it changes anything (logged once)."""
    plan, new_plan, what = runtime.plan, found.outcome, found.what
    if isinstance(new_plan, str):
        # The running plan and its profile stay as they were: a calibrated profile kept beside
        # the plan's old prediction would be calibrated again from it at the next check, each
        # time on top of the last (the drift checks repeat every window).
        warn_once(
            "calibration-no-plan",
            f"autooffload: {what}, and no plan fits the budget ({new_plan}); the plan stays;"
            " set AUTOOFFLOAD_BUDGET lower to leave the allocator more room",
        )
        return None
    runtime.control.adopt_profile(found.profile, found.request)
    # last_plan() reports the calibrated prediction whether or not the configuration changes
    # (it reported the stale one when the plan stayed, beside candidates from the new model).
    registry.set_last_plan(new_plan)
    if new_plan.configures_like(plan):
        runtime.control.adopt_plan(new_plan)
        (logger.debug if found.drift else logger.info)(
            "%s; the plan stays (predicted step now %.0f ms)", what, new_plan.predicted_step_s * 1e3
        )
        return None
    runtime.apply_plan(new_plan)
    if runtime.manager.is_cuda:
        fresh_peak(runtime.device)
    logger.info("%s, re-planned:\n%s", what, new_plan.summary(runtime.device.type))
    return new_plan
