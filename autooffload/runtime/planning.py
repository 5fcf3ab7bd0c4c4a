"""The plan a runtime starts with: user overrides first, then a memory-bounded default."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from autooffload.errors import PlanError
from autooffload.log import logger
from autooffload.plan.hardware import measure_hardware
from autooffload.plan.profile_types import HardwareProfile, ModelProfile
from autooffload.plan.search import search
from autooffload.plan.types import Plan
from autooffload.settings import Settings

if TYPE_CHECKING:
    from autooffload.runtime.runtime import Runtime


BUDGET_MARGIN_SHARE = 0.04
BUDGET_MARGIN_MIN = 256 << 20


def budget_bytes(settings: Settings, device: torch.device) -> int | None:
    """The GPU memory budget in bytes: ``settings.budget`` (bytes or a fraction of the device),
    capped by what the device has free; ``None`` on the CPU simulation without a budget."""
    if device.type != "cuda":
        if settings.budget is None or isinstance(settings.budget, float):
            return None
        return int(settings.budget)
    free, total = torch.cuda.mem_get_info(device)
    fraction_cap = total
    limit = Settings.resolve_bytes(settings.budget, total) if settings.budget is not None else None
    available = free + torch.cuda.memory_reserved(device)
    if limit is None:
        return min(available, fraction_cap) - (1 << 30)
    return min(limit, available)


def persistent_cost(chunk_bytes: int, trainable_bytes: int) -> int:
    """GPU bytes a chunk costs when persistent: weights, their grads and two optimizer states
    in the param dtype (torch AdamW on bf16 params): nbytes + 3 * trainable bytes."""
    return chunk_bytes + 3 * trainable_bytes


def initial_plan(runtime: Runtime, settings: Settings) -> Plan:
    """The plan used until the profiler has measured the real batch."""
    chunks = runtime.layout.chunks
    n_chunks = len(chunks)
    chunk_size = runtime.layout.chunk_size
    widest = max((len(v) for v in runtime.layout.chunks_of_group.values()), default=1)
    n_buffer = settings.n_buffer if settings.n_buffer is not None else 2 * widest
    if n_buffer < widest and settings.n_buffer is not None:
        raise PlanError(
            f"n_buffer={settings.n_buffer} is smaller than the {widest} chunks one block needs;"
            f" set AUTOOFFLOAD_N_BUFFER >= {widest} (or leave it unset)"
        )
    budget = budget_bytes(settings, runtime.device)
    if settings.n_persist is not None:
        if settings.n_persist > n_chunks:
            raise PlanError(
                f"n_persist={settings.n_persist} exceeds the model's {n_chunks} chunks;"
                f" set AUTOOFFLOAD_N_PERSIST between 0 and {n_chunks}"
            )
        n_persist = settings.n_persist
        source = "user"
    elif not settings.offload:
        n_persist = n_chunks
        source = "offload off"
    else:
        # Conservative first step: nothing persistent, every block checkpointed, so the
        # profiling step cannot run out of memory; the plan from the real batch follows it.
        n_persist = 0
        source = "profiling step"
    persistent_bytes = sum(persistent_cost(c.nbytes, c.trainable_bytes) for c in chunks[:n_persist])
    n_off = n_chunks - n_persist
    streamed = min(n_buffer, n_off) * max((c.nbytes for c in chunks[n_persist:]), default=0)
    return Plan(
        chunk_size=chunk_size,
        n_chunks=n_chunks,
        n_persist=n_persist,
        n_buffer=n_buffer,
        budget_bytes=budget,
        predicted_peak_bytes=persistent_bytes + streamed,
        bottleneck="not profiled yet (model states only)",
        source=source,
    )


def optim_state_bytes(optimizer: torch.optim.Optimizer | None, dtype: torch.dtype) -> int:
    """GPU optimizer-state bytes per persistent trainable element (torch keeps states in the
    param dtype): Adam-family 2 states, SGD with momentum / Adagrad / RMSprop 1."""
    element = torch.empty((), dtype=dtype).element_size()
    if optimizer is None:
        return 2 * element
    name = type(optimizer).__name__
    if name in ("Adam", "AdamW", "Adamax", "NAdam", "RAdam"):
        return 2 * element
    if name == "SGD":
        return element if any(g.get("momentum", 0) for g in optimizer.param_groups) else 0
    return element


def plan_from_profile(
    runtime: Runtime, profile: ModelProfile, cpu_optim_rate: float | None = None
) -> Plan:
    """Search the plan for the measured ``profile`` under the budget; user knobs stay fixed."""
    settings = runtime.settings
    fixed: dict[str, int] = {}
    for knob in ("n_persist", "n_buffer", "n_swap", "n_checkpoint"):
        value = getattr(settings, knob)
        if value is not None:
            fixed[knob] = value
    n_blocks = profile.n_blocks
    mode = settings.activation_mode
    if mode in ("keep", "off"):
        fixed.update(n_swap=0, n_checkpoint=0)
    elif mode == "checkpoint":
        fixed.update(n_swap=0, n_checkpoint=n_blocks)
    elif mode == "swap":
        fixed.update(n_swap=n_blocks, n_checkpoint=0)
    if not settings.offload:
        fixed["n_persist"] = profile.n_chunks
    hw = replace(hardware_profile(runtime), cuda_context_bytes=0)
    if cpu_optim_rate is not None:
        logger.debug(
            "CPU optimizer measured in the profiling step: %.2f Gparam/s (hardware probe %.2f)",
            cpu_optim_rate / 1e9,
            hw.cpu_optim_params_per_s / 1e9,
        )
        hw = replace(hw, cpu_optim_params_per_s=cpu_optim_rate)
    budget = budget_bytes(settings, runtime.device)
    if budget is not None and runtime.device.type == "cuda":
        # Headroom for what the model does not see: allocator growth at the cap costs a
        # cudaFree + synchronize per retry, far more than the memory it saves.
        budget -= max(BUDGET_MARGIN_MIN, int(BUDGET_MARGIN_SHARE * budget))
    return search({profile.chunk_size: profile}, hw, budget, fixed)


def hardware_profile(runtime: Runtime) -> HardwareProfile:
    """The machine's measured profile (cached per machine in ``settings.cache_dir``)."""
    optimizer = runtime.cpu_optim.optimizer
    cls = type(optimizer) if optimizer is not None else torch.optim.AdamW
    return measure_hardware(
        runtime.device,
        runtime.settings.cache_dir,
        reprofile=runtime.settings.reprofile,
        optimizer_cls=cls,
    )
