"""The smaller plan an OOM retry runs under: the budget it plans for, the search with the
persistent chunks pinned, and the profiling plan of a much longer batch.

A batch more than ``REPROFILE_RATIO`` times the profiled one's input size is retried under the
conservative plan of a profiling step (persistent chunks kept, every block checkpointed) and that
retried step is profiled: the next forward runs the plan searched from the real batch (never
with fewer persistent chunks). Otherwise shrinking keeps the persistent chunks (their optimizer
state lives in the user's optimizer and demotion is not supported): the search re-runs with
``n_persist`` pinned, on the profile scaled to the failed batch's size, under a budget that
depends on whether the model explains the OOM. If the current plan's predicted peak for this
batch exceeds the memory available (a longer batch than profiled), the budget is that memory
less ``OOM_BUDGET_CUT``; if it did not (the prediction was short), the budget is the prediction
less the failed allocation's size (at least ``OOM_BUDGET_CUT`` of it). Buffers and activation
policies (more checkpointing or swapping) absorb the cut.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import TYPE_CHECKING

from autooffload.errors import PlanError
from autooffload.log import logger
from autooffload.plan.profile_types import ModelProfile
from autooffload.plan.search import make_plan
from autooffload.plan.types import Plan
from autooffload.runtime.control.planning import (
    REPROFILE_SOURCE,
    budget_bytes,
    hardware_profile,
    plan_from_profile,
    profile_for_plan,
)

if TYPE_CHECKING:
    from autooffload.runtime.runtime import Runtime

# The retry's budget is cut by at least this share: of the memory available when the scaled
# profile explains the OOM, else of the current plan's predicted peak (``shrunk_plan``).
OOM_BUDGET_CUT = 0.1
# A batch this many times the profiled one's input size is profiled again instead of having
# the profile extrapolated: fixed-size parts of a short batch's measured transients (a library's
# workspace, a loss chunk) scaled 128x made a 2.7 GiB need read as 10 GiB on an H100.
REPROFILE_RATIO = 2.0
_ALLOCATION = re.compile(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)")


def failed_allocation_bytes(message: str) -> int:
    """The failed allocation's size from torch's OOM message (0 if it does not say)."""
    match = _ALLOCATION.search(message)
    if match is None:
        return 0
    units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
    return int(float(match.group(1)) * units[match.group(2)])


def shrunk_plan(
    runtime: Runtime, requested_bytes: int, batch_ratio: float, held_bytes: int = 0
) -> Plan | None:
    """A plan predicted to use less memory than ``runtime``'s current one, with the same
    persistent chunks, for a batch ``batch_ratio`` times the profiled one's input size, beside
    ``held_bytes`` that stay allocated through the retry (``retry_budget``); None if there is
    none."""
    current = runtime.plan
    profile = runtime.profile
    if profile is None or runtime.control.profiling:
        # Before the searched plan: nothing is persistent and every block checkpointed;
        # only the streaming buffers can go, down to the widest block's chunks.
        widest = max((len(v) for v in runtime.layout.chunks_of_group.values()), default=1)
        if current.n_buffer <= widest:
            return None
        return replace(current, n_buffer=widest, source="OOM retry")
    if batch_ratio > REPROFILE_RATIO:
        return _reprofiling_plan(runtime)
    if batch_ratio > 1.0:
        profile = profile.with_batch_scaled(batch_ratio)
    budget = retry_budget(runtime, profile, requested_bytes, held_bytes)
    try:
        plan = plan_from_profile(
            runtime, profile, budget=budget, pinned={"n_persist": current.n_persist}
        )
    except PlanError as error:
        logger.debug("no plan fits the OOM retry's budget %d: %s", budget, error)
        return None
    if plan.configures_like(current):
        return None
    return replace(plan, chunk_size=runtime.layout.chunk_size, source="OOM retry")


def retry_budget(
    runtime: Runtime, profile: ModelProfile, requested_bytes: int, held_bytes: int = 0
) -> int:
    """The budget the retry plans for, from the current plan's predicted peak on ``profile``
    (the failing batch's) and the memory available, less ``held_bytes`` that stay allocated
    beside the retried pass (a failed backward's graph the script still references)."""
    current = runtime.plan
    hw = replace(hardware_profile(runtime), cuda_context_bytes=0)
    # What the current plan needs for this batch (predicted on the profile variant it was
    # searched on), the budget it had, and (on a GPU) what is available now: another
    # process may have taken memory since the plan was made.
    planned = profile_for_plan(profile, current, hw)
    needed = make_plan(planned, hw, current.knobs, None).predicted_peak_bytes
    limits = [current.budget_bytes]
    if runtime.manager.is_cuda:
        limits.append(budget_bytes(runtime.settings, runtime.device))
    available = min((b for b in limits if b), default=None)
    if available is not None and needed > available:
        # The batch outgrew the plan and the scaled profile says by how much: what is
        # available, less the cut as a margin, holds the new plan.
        return available - int(OOM_BUDGET_CUT * available) - held_bytes
    # The model thought the plan fitted: its prediction was short by at least the failed
    # allocation; plan for less than it predicted by that much.
    return needed - max(requested_bytes, int(OOM_BUDGET_CUT * needed)) - held_bytes


def _reprofiling_plan(runtime: Runtime) -> Plan:
    """The conservative plan of a profiling step, keeping the persistent chunks: every block
    checkpointed (unless the user fixed the activation mode), no more buffers than the
    current plan's or two blocks' worth."""
    current = runtime.plan
    widest = max((len(v) for v in runtime.layout.chunks_of_group.values()), default=1)
    policies = current.block_policies
    if runtime.settings.activation_mode == "auto":
        policies = ("checkpoint",) * len(runtime.activations.blocks_in_order())
    return replace(
        current,
        n_buffer=max(widest, min(current.n_buffer, 2 * widest)),
        block_policies=policies,
        mlp_tile_tokens=0,
        predicted_peak_bytes=None,
        predicted_step_s=None,
        bottleneck="not profiled yet (re-profiling a longer batch)",
        source=REPROFILE_SOURCE,
        update=None,
        breakdown={},
    )
