"""``PlanControl``: the plan a runtime runs and what it was decided from (the profiling steps,
the search, the calibration schedule); its state changes through its methods only.

A run goes through three phases, each owned here:
- **profiling**: the conservative initial plan runs while a ``StepProfiler`` watches two
  optimizer steps (the first pays one-time costs; the second is measured), or one where the
  first takes ``MEASURE_FIRST_STEP_S`` or longer. Its profile is
  searched at the next forward (``before_forward``): other optimizers of the model step after
  the one that ended the profile.
- **calibrating**: the searched plan runs; ``CalibrationSchedule`` compares its measured peak,
  CPU rate, copy rates and step with the plan's assumptions a few steps on, and may re-plan.
- **settled**: the same checks every drift window.
An OOM retry of a much longer batch re-enters profiling (``reprofile``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from autooffload.errors import PlanError
from autooffload.log import logger, warn_once
from autooffload.plan.profile_types import ModelProfile
from autooffload.plan.search import SearchRequest
from autooffload.plan.types import Plan
from autooffload.runtime import registry
from autooffload.runtime.control.calibration import (
    NO_WORKER_MARK,
    CalibrationSchedule,
    WorkerMark,
    accumulate_rate,
    worker_rate,
)
from autooffload.runtime.control.planning import (
    REPROFILE_SOURCE,
    accumulate_mode,
    gpu_update_in_backward_mode,
    gpu_update_mode,
    search_request,
    step_profile,
)
from autooffload.runtime.control.profiler import StepProfiler

# A first profiling step at least this long is measured itself instead of being followed by a
# second: its one-time costs (kernel selection, the allocator's growth, lazily made state) are a
# few percent of it at most, and a long sequence's step takes minutes (Llama-3-8B LoRA at seq
# 131072 about one, at 524288 over ten). Data-parallel ranks follow rank 0's step.
MEASURE_FIRST_STEP_S = 20.0

if TYPE_CHECKING:
    from autooffload.runtime.runtime import Runtime


@dataclass(frozen=True)
class PendingSwitch:
    """A finished profile waiting for the next forward to be searched and switched to, with the
    CPU worker's rates measured in its step (None where unmeasured)."""

    profile: ModelProfile
    cpu_rate: float | None
    accumulate_rate: float | None


class PlanControl:
    """The running plan, the profile and search it came from, the profiler of the profiling
    steps and the calibration schedule of one runtime."""

    def __init__(self, runtime: Runtime, plan: Plan) -> None:
        self._runtime = runtime
        self._plan = plan
        self._profile: ModelProfile | None = None
        self._search_request: SearchRequest | None = None
        self._refused_request: SearchRequest | None = None
        self._profiler: StepProfiler | None = None
        self._pending: PendingSwitch | None = None
        self._profiling_peak_bytes: int | None = None
        # The CPU worker's counters when it was last known idle: the start of the window its
        # rate is measured over (``calibration.worker_rate``).
        self._worker_mark: WorkerMark = NO_WORKER_MARK
        self.calibration = CalibrationSchedule()

    # ---- reads ------------------------------------------------------------------------------

    @property
    def plan(self) -> Plan:
        return self._plan

    @property
    def profile(self) -> ModelProfile | None:
        """The profile the running plan was searched on (calibrated since), None before one."""
        return self._profile

    @property
    def search_request(self) -> SearchRequest | None:
        """The search behind the running plan (``Runtime.candidates`` re-runs it)."""
        return self._search_request

    @property
    def refused_request(self) -> SearchRequest | None:
        """The search that found no plan before the first update (``before_update``), kept so
        that a refused budget can be searched again offline; None otherwise."""
        return self._refused_request

    @property
    def profiler(self) -> StepProfiler | None:
        """The profiler of the running profiling step, None outside the profiling phase."""
        return self._profiler

    @property
    def profiling(self) -> bool:
        return self._profiler is not None

    @property
    def profiling_peak_bytes(self) -> int | None:
        """Device bytes the allocator held in the profiling steps (CUDA only, once measured)."""
        return self._profiling_peak_bytes

    @property
    def worker_mark(self) -> WorkerMark:
        return self._worker_mark

    @property
    def settled(self) -> bool:
        """The searched plan runs and its first checks are over: the steady state."""
        return self._profiler is None and self._pending is None and self.calibration.settled

    # ---- changes ----------------------------------------------------------------------------

    def adopt_plan(self, plan: Plan) -> None:
        """``plan`` is the running one: switched to by ``Runtime.apply_plan``, agreed by the
        data-parallel ranks, or the same configuration with a calibrated prediction."""
        self._plan = plan

    def adopt_profile(self, profile: ModelProfile, request: SearchRequest | None = None) -> None:
        """The running plan's predictions come from ``profile`` (and ``request``) from now on."""
        self._profile = profile
        if request is not None:
            self._search_request = request

    def start_profiling(self, warm: bool = False) -> None:
        """A profiling step starts (``warm``: the measured one, after the warm-up step)."""
        self._profiler = StepProfiler(self._runtime, warm=warm)

    def restart_profiling(self) -> None:
        """A failed pass left the profiling step's marks partial: that step starts over."""
        if self._profiler is not None:
            self.start_profiling(warm=self._profiler.warm)

    def close(self) -> None:
        """At detach: no profiling step, and no reference back to the runtime (a cycle that
        would keep a dropped runtime and its model alive until a cyclic gc)."""
        self._profiler = None
        del self._runtime

    def mark_worker(self) -> None:
        """The CPU worker is idle now: its measured window starts here."""
        self._worker_mark = self._runtime.cpu_optim.mark()

    def reprofile(self) -> None:
        """An OOM retry of a much longer batch: the retried pass is a measured profiling step of
        that batch, with the worker idle at its start as for the first profile."""
        self._runtime.cpu_optim.wait()
        self.mark_worker()
        self.start_profiling(warm=True)

    # ---- the step's events ------------------------------------------------------------------

    def before_forward(self) -> None:
        """A forward starts: a profile finished at the last step is searched and switched to."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.switch_to_searched_plan(pending.profile, pending.cpu_rate, pending.accumulate_rate)

    def before_update(self, optimizer: torch.optim.Optimizer) -> None:
        """Before the run's first update: refuse a budget no plan fits
        (the search of the first profiling step's sizes)."""
        runtime = self._runtime
        profiler = self._profiler
        if profiler is None or profiler.warm or runtime.data_parallel is not None:
            return
        if not runtime.step_state.backwards_this_step or self._plan.budget_bytes is None:
            return
        request = search_request(runtime, step_profile(runtime, profiler, optimizer))
        try:
            request.plan()
        except PlanError as error:
            self._refused_request = request
            raise PlanError(f"before the first update: {error}") from None

    def profile_after_step(self, optimizer: torch.optim.Optimizer) -> ModelProfile | None:
        """At an optimizer step of the profiling phase: after the first (which pays one-time
        costs) the second is measured; after the second, its measurements become the model's
        profile, returned (None at every other step)."""
        runtime = self._runtime
        profiler = self._profiler
        if profiler is None or not runtime.step_state.backwards_this_step:
            return None
        if not profiler.warm:
            elapsed = profiler.elapsed_s()
            long_first = elapsed >= MEASURE_FIRST_STEP_S
            if runtime.data_parallel is not None:  # every rank as rank 0 decides
                long_first = bool(runtime.data_parallel.agree_object(long_first))
            if not long_first:
                self.start_profiling(warm=True)
                return None
            logger.info(
                "the first profiling step took %.0f s: it is measured itself, no second one",
                elapsed,
            )
        # Probe before the CPU update starts: it would compete for the host cores that launch
        # the probe's kernels and inflate the measured block times.
        self._profiler = None
        runtime.cpu_optim.wait()
        runtime.backward_update.decide()
        profile = step_profile(runtime, profiler, optimizer)
        return replace(
            profile,
            gpu_update=gpu_update_mode(runtime),
            gpu_update_in_backward=gpu_update_in_backward_mode(runtime),
            accumulate_on=accumulate_mode(runtime),
        )

    def after_update(self, profile: ModelProfile | None, updated: bool) -> None:
        """The step's CPU update was queued (``updated``): at the end of the profiling phase
        measure the worker as it ran this step and keep the profile for the next forward;
        before the measured profiling step, let the worker finish so its blocks are timed on
        an idle host."""
        runtime = self._runtime
        cpu_rate = accumulate = None
        if updated and profile is not None:
            # As the step runs it (accumulation, copies, thread count included; the previous
            # profiling step left the worker idle): micro-benchmarks of the optimizer alone
            # overstate it.
            runtime.cpu_optim.wait()
            cpu_rate = worker_rate(self._worker_mark, runtime.cpu_optim)
            accumulate = accumulate_rate(self._worker_mark, runtime.cpu_optim)
        elif updated and self._profiler is not None:
            # Launch-bound timings of blocks beside a running update doubled the predicted step
            # and made the plan vary from run to run.
            runtime.cpu_optim.wait()
            self.mark_worker()
        if profile is not None:
            self._pending = PendingSwitch(profile, cpu_rate, accumulate)

    def end_step(self, backwards: int) -> None:
        """The step is over (``backwards`` backward passes): time it, and run a calibration
        check that is due."""
        self.calibration.mark_step(backwards)
        if self.calibration.due(self._runtime.steps_taken):
            self.calibration.check(self._runtime)

    def without_update_in_backward(self) -> None:
        """The auto mode turned the update in the backward off: the next calibration
        re-predicts without it."""
        if self._profile is not None:
            self._profile = replace(self._profile, update_in_backward=False)

    def switch_to_searched_plan(
        self,
        profile: ModelProfile,
        cpu_rate: float | None,
        accumulate_rate: float | None = None,
    ) -> None:
        """Search the plan for the measured ``profile`` (rank 0's under data parallelism),
        switch to it, log it once (print it and exit under ``--print-plan``). ``cpu_rate`` and
        ``accumulate_rate``: the CPU worker's update and gradient-add rates in the profiling
        step, None if unmeasured."""
        runtime = self._runtime
        # The profiling steps' host buffers go (their memory counts as available again): the
        # searched plan's are of other sizes, and idle ones counted as room overstated it.
        runtime.activations.free_idle_host_buffers()
        request = search_request(runtime, profile, cpu_rate, accumulate_rate=accumulate_rate)
        # A profile taken again later (an OOM retry of a longer batch) keeps the persistent
        # chunks: their optimizer state lives in the user's optimizer.
        floor = len(runtime.manager.persistent) if self._plan.source == REPROFILE_SOURCE else 0
        request = replace(request, min_persist=floor)
        try:
            plan = replace(request.plan(), chunk_size=runtime.layout.chunk_size)
            if not floor:
                request, profile, plan = runtime.backward_update.choose(request, profile, plan)
        except PlanError as error:
            if not floor:
                raise
            # The re-profiled batch ran under the conservative plan: it stays (it fits for
            # real; the prediction with the budget's margins does not).
            self._profile = profile
            warn_once(
                "reprofile-no-plan",
                f"autooffload: no plan keeping the {floor} persistent chunks fits the budget for"
                f" the longer batch ({error}); the re-profiling plan (every block checkpointed)"
                " stays; raise AUTOOFFLOAD_BUDGET (unset, 1 GiB stays free) for a faster one",
            )
            return
        if runtime.data_parallel is not None:
            plan = runtime.data_parallel.agree(plan)
        self.adopt_profile(profile, request)
        runtime.apply_plan(plan)
        if runtime.manager.is_cuda:
            # The planned steps' peak, not the profiling steps', is compared with the
            # prediction; the profiling steps' own is kept (the least memory a run needs).
            self._profiling_peak_bytes = torch.cuda.max_memory_reserved(runtime.device)
            # The worker is idle here (the last profiling step waited for its update).
            self.calibration.arm(runtime, plan)
        registry.set_last_plan(plan)
        summary = plan.summary(runtime.device.type)
        if runtime.settings.print_plan:
            print(summary, flush=True)  # noqa: T201 - the launcher's --print-plan
            raise SystemExit(0)
        logger.info("%s", summary)
