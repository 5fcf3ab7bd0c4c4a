"""When the CPU update of offloaded chunks runs in the backward: the setting, or the loop's say.

An update in the backward (ProTrain's overlap; ``CpuOptimizer._update_now``) starts each
offloaded chunk's CPU update as soon as its gradients arrive, so the CPU works through the
backward instead of idling until ``optimizer.step()``. It is exact only when ``step()`` follows
every backward and nothing between them reads or changes what the update uses: no clipping, no
GradScaler, no gradient accumulation, no zero_grad without a step, no hyperparameter change.

``AUTOOFFLOAD_UPDATE_IN_BACKWARD=auto`` (the default) watches the profiling steps (or the first
step of a fixed plan) for those events (``EarlyUpdates.check_no_early_update`` records each one
seen between a backward and its step; ``observe`` adds accumulation and hyperparameter
changes). For a loop that showed none, the first search is run both ways and the update in the
backward is taken only when it is predicted ``CHOOSE_GAIN`` faster (``choose``): it makes the
CPU update contend with the backward's own host work, which the cost model does not see
(3.6B @ 16 GiB on an H100 measured it 0.94x-1.47x the update at step()). Under it the
persistent chunks are stepped in the backward too (``runtime/update/persistent_update.py``), so
``decide`` also wants every trained chunk param in a bound optimizer. Two more guards keep it
safe to have on by default:

- A step whose forward input is larger than any trained so far runs without the CPU part, so
  an OOM in its backward can still be retried (a retry after early updates would update
  twice) until the persistent chunks' steps, which come late in the backward.
- A reason seen later in a step that updated nothing early turns it off for the rest of the
  run; one seen after early updates raises ``UpdateInBackwardError``, as under ``=1``.

Under data parallelism an offloaded chunk's gradients reach the CPU averaged across ranks (its
owner's, under sharded state), so its update in the backward is the same update; the
persistent chunks are stepped at ``step()`` there (their gradients are averaged in place and
held until then: ``ModelProfile.persistent_at_step``). The decision is agreed: on only where no
rank saw a reason (``decide``), and rank 0's choice between the two searches (``choose``).
Whether a rank updates a chunk early or at ``step()`` changes no collective, so a rank that
turns it off alone (a larger batch, a later reason) still pairs its collectives with the rest.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from autooffload.errors import PlanError
from autooffload.log import logger
from autooffload.runtime.update.in_backward import SHARED
from autooffload.runtime.update.persistent_update import raw_step

if TYPE_CHECKING:
    from autooffload.plan.profile_types import ModelProfile
    from autooffload.plan.search import SearchRequest
    from autooffload.plan.types import Plan
    from autooffload.runtime.runtime import Runtime

# The share by which the plan with the update in the backward must be predicted faster than the
# one without for the auto mode to take it.
CHOOSE_GAIN = 0.05
AUTO_ORIGIN = (
    "AUTOOFFLOAD_UPDATE_IN_BACKWARD=auto, on since the profiling steps neither clipped,"
    " accumulated nor read the gradients before optimizer.step()"
)


class BackwardUpdateMode:
    """Whether the runtime's CPU update runs in the backward, step by step."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.setting = runtime.settings.update_in_backward
        # True/False once known: the setting, else the auto mode's decision (None: observing).
        self.decided: bool | None = self.setting
        # Largest forward input (elements) of a completed step: a larger one may not fit the
        # plan, and its backward must stay retryable.
        self.trained_numel = 0
        # The auto mode's first search: predicted step seconds with and without it.
        self.predicted: tuple[float, float] | None = None
        early = runtime.cpu_optim.early
        if self.setting is None:
            early.set_origin(AUTO_ORIGIN)
            static = self._static_reasons()
            if static:
                self._settle(False, static)
        early.observe(self.decided is None)

    def close(self) -> None:
        """At detach: no reference back to the runtime (a cycle that would keep a dropped
        runtime and its model alive until a cyclic gc)."""
        del self.runtime

    def _static_reasons(self) -> list[str]:
        reasons = []
        if self.runtime.settings.gpu_update_chunks != 0:
            reasons.append("the GPU update path (AUTOOFFLOAD_GPU_UPDATE_CHUNKS) updates at step()")
        return reasons

    @property
    def on(self) -> bool:
        """Whether the plan is searched, and the planned steps run, with the update in the
        backward."""
        return bool(self.decided)

    def observe(self, optimizer: torch.optim.Optimizer, backwards: int) -> None:
        """At ``optimizer.step()``, first: what this step did that the auto mode must know."""
        early = self.runtime.cpu_optim.early
        if early.observing:
            early.note_step_hyper(optimizer)
        if backwards > 1:
            early.add_reason(
                f"{backwards} backward passes per optimizer step (gradient accumulation)"
            )

    def decide(self) -> None:
        """End of the observation (the profile is about to be built): on when nothing seen
        so far argues against it."""
        if self.decided is None:
            reasons = self.runtime.cpu_optim.early.loop_reasons | set(self._unstepped())
            dp = self.runtime.data_parallel
            if dp is not None:
                # A collective (every rank decides at the same step): on only where no rank
                # saw a reason, so that every rank plans alike.
                reasons = set().union(*dp.gather_object(sorted(reasons)))
            self._settle(not reasons, reasons)

    def _unstepped(self) -> list[str]:
        """Why some trained chunk param could not be stepped in the backward: the update in
        the backward steps persistent chunks with their owners
        (runtime/update/persistent_update.py), and the plan counts their gradients as dropped
        there. Under data parallelism they are stepped at ``step()``, once averaged: nothing to
        check."""
        if self.runtime.data_parallel is not None:
            return []
        twins = self.runtime.cpu_optim.twins
        for chunk in self.runtime.layout.chunks:
            for slot in chunk.trainable_slots:
                owners = twins.owners(id(slot.param))
                if not owners:
                    return [
                        f"trained parameter {slot.name} is in no optimizer that autooffload"
                        " binds (a torch.optim one that also holds offloaded parameters)"
                    ]
                if len(owners) > 1:
                    return [SHARED]
                if raw_step(owners[0]) is None:
                    name = type(owners[0]).__name__
                    return [f"{name}.step is not wrapped by torch's step hooks"]
        return []

    def choose(
        self, request: SearchRequest, profile: ModelProfile, plan: Plan
    ) -> tuple[SearchRequest, ModelProfile, Plan]:
        """Auto mode, the first search of a loop it suits: ``plan`` was searched with the update
        in the backward; search without it too and keep the faster by ``CHOOSE_GAIN`` (the
        request, profile and plan to run)."""
        if self.setting is not None or not profile.update_in_backward or self.predicted:
            return request, profile, plan
        without_profile = replace(profile, update_in_backward=False)
        profiles = {
            size: replace(p, update_in_backward=False)
            for size, p in request.profiles_by_chunk_size.items()
        }
        without_request = replace(request, profiles_by_chunk_size=profiles)
        try:
            without: Plan | None = replace(without_request.plan(), chunk_size=plan.chunk_size)
        except PlanError:
            without = None
        with_s = plan.predicted_step_s or 0.0
        without_s = (without.predicted_step_s or 0.0) if without is not None else math.inf
        keep = with_s <= (1 - CHOOSE_GAIN) * without_s
        if self.runtime.data_parallel is not None:
            # Rank 0's choice on every rank (profiles differ per rank; plans must not, and
            # rank 0's plan is the one every rank runs: ``PlanControl.switch_to_searched_plan``).
            with_s, without_s, keep = self.runtime.data_parallel.agree_object(
                (with_s, without_s, keep)
            )
        self.predicted = (with_s, without_s)
        if keep:
            return request, profile, plan
        self._settle(
            False,
            [f"predicted {with_s * 1e3:.0f} ms per step with it, {without_s * 1e3:.0f} ms without"],
        )
        self.runtime.cpu_optim.in_backward.arm(offloaded=False, persistent=False)
        return without_request, without_profile, plan if without is None else without

    def _settle(self, on: bool, reasons: list[str] | set[str]) -> None:
        self.decided = on
        self.runtime.cpu_optim.early.observe(False)
        if not on:
            logger.debug("update in the backward off: %s", "; ".join(sorted(reasons)))

    def note_forward(self, input_numel: int) -> None:
        """A forward of the whole model (``OomRetry``): no update in the backward of a batch
        larger than any trained, so an OOM there can be retried."""
        if self.setting is None and input_numel > self.trained_numel:
            self.runtime.cpu_optim.in_backward.arm(offloaded=False)

    def end_step(self, input_numel: int) -> None:
        """At the end of the runtime's step: settle the auto mode, arm the next step."""
        runtime = self.runtime
        early = runtime.cpu_optim.early
        profiling = runtime.control.profiling
        if self.decided is None and not profiling:
            self.decide()  # a fixed plan: no profiling steps, the first step decides
        elif self.setting is None and self.decided and early.loop_reasons:
            # Seen in a step that updated nothing early (else it raised), or that left the
            # chunks it concerned to step() (``ACCUMULATED``): off from now on. Such
            # a step stepped no persistent chunk either (they stay armed), so none had
            # gradients: keeping them to step() from now on needs no memory the plan lacks.
            reasons = "; ".join(sorted(early.loop_reasons))
            logger.info(
                "autooffload: offloaded chunks are updated at optimizer.step() from now on: the"
                " loop did this between a backward and its step: %s",
                reasons,
            )
            self.decided = False
            runtime.control.without_update_in_backward()
        early.step_done()
        self.trained_numel = max(self.trained_numel, input_numel)
        # Updates in the backward start once the conservative profiling steps are over.
        # Persistent chunks are stepped in every backward under it, larger batches too: the
        # plan counts on their gradients being dropped, and they are stepped late in the
        # backward, when an OOM is least likely (the retry refuses a backward after them).
        # Under data parallelism they are stepped at step(), once averaged across ranks.
        runtime.cpu_optim.in_backward.arm(
            offloaded=self.on and not profiling,
            persistent=self.on and runtime.data_parallel is None,
        )
