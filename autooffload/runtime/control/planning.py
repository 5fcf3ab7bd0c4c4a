"""The plan a runtime starts with (user overrides first, then a memory-bounded default), and the
search request built from a profile and the run's settings."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from autooffload.errors import PlanError
from autooffload.log import logger
from autooffload.plan.configuration import (
    serves_chunks,
    with_accumulation_of,
    with_checkpoint_inputs_on_cpu,
    with_mlp_tiles,
    with_served_chunks_gathered,
)
from autooffload.plan.hardware import cached_hardware, measure_hardware, reprofile_forced
from autooffload.plan.profile_types import HardwareProfile, ModelProfile
from autooffload.plan.search import SearchRequest
from autooffload.plan.types import Plan, format_bytes
from autooffload.plan.update_split import GPU_UPDATE_AUTO, GPU_UPDATE_OFF
from autooffload.runtime.control.host_need import host_room_for_activations
from autooffload.runtime.control.profiler import StepProfiler
from autooffload.runtime.host_vocab import servable_chunks
from autooffload.runtime.parallel.distributed import local_world_size, world
from autooffload.settings import Settings

if TYPE_CHECKING:
    from autooffload.runtime.runtime import Runtime


# Without AUTOOFFLOAD_BUDGET: all free memory minus this (CUDA context growth, other libraries).
DEFAULT_SAFETY_MARGIN = 1 << 30
# The source of the plan an OOM retry of a much longer batch runs while profiling it
# (``runtime/control/oom.py``); the plan searched from that profile keeps its persistent chunks.
REPROFILE_SOURCE = "OOM retry, re-profiling"
# On a CUDA device the search plans for the budget less this margin (``search_request``).
BUDGET_MARGIN_SHARE = 0.04
BUDGET_MARGIN_MIN = 256 << 20


def cap_for_peak(peak: int) -> int:
    """The smallest CUDA budget whose searched plans may peak at ``peak`` bytes: the budget less
    its margin (``BUDGET_MARGIN_SHARE`` of it, at least ``BUDGET_MARGIN_MIN``) holds the peak."""
    return max(peak + BUDGET_MARGIN_MIN, math.ceil(peak / (1 - BUDGET_MARGIN_SHARE)))


def budget_bytes(settings: Settings, device: torch.device) -> int | None:
    """The GPU memory budget in bytes: ``settings.budget`` (bytes or a fraction of the device),
    capped by what the device has free; ``None`` on the CPU simulation without a budget."""
    if device.type != "cuda":
        if settings.budget is None or isinstance(settings.budget, float):
            return None
        return int(settings.budget)
    free, total = torch.cuda.mem_get_info(device)
    # torch.cuda.set_per_process_memory_fraction (several processes sharing a GPU, benchmark
    # caps) bounds what this process's allocator may reserve, whatever the device has free.
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.8
    fraction = get_fraction(device) if get_fraction is not None else 1.0
    fraction_cap = int(fraction * total)
    limit = Settings.resolve_bytes(settings.budget, total) if settings.budget is not None else None
    available = min(free + torch.cuda.memory_reserved(device), fraction_cap)
    if limit is None:
        return available - DEFAULT_SAFETY_MARGIN
    return min(limit, available)


def persistent_cost(chunk_bytes: int, trainable_bytes: int) -> int:
    """GPU bytes a chunk costs when persistent: weights, their grads and two optimizer states
    in the param dtype (torch AdamW on bf16 params): nbytes + 3 * trainable bytes."""
    return chunk_bytes + 3 * trainable_bytes


def model_state_peak(
    chunks: list, n_persist: int, n_buffer: int, served: dict[int, int] | None = None
) -> int:
    """Device bytes of the model states alone: the persistent chunks (with their grads and
    optimizer states) and the widest run of ``n_buffer`` consecutive streamed chunks, a chunk
    served from the host (``served``: index -> device bytes while serving) counting those."""
    persistent_bytes = sum(persistent_cost(c.nbytes, c.trainable_bytes) for c in chunks[:n_persist])
    served = served or {}
    # Streamed chunks take their own size on the device (an oversized embedding's chunk beside
    # small ones), about n_buffer consecutive ones at a time.
    streamed_sizes = [served.get(c.index, c.nbytes) for c in chunks[n_persist:]]
    streamed = max(
        (sum(streamed_sizes[i : i + n_buffer]) for i in range(len(streamed_sizes))), default=0
    )
    return persistent_bytes + streamed


def served_device_bytes(runtime: Runtime) -> dict[int, int]:
    """The device bytes of each chunk the smallest plan serves from the host (a frozen
    vocabulary on one process, ``runtime/host_vocab.py``): a head's two tiles, an embedding's
    rows (counted as none: they are the batch's, not the model's)."""
    if world()[1] > 1 and runtime.settings.data_parallel != "off":
        return {}
    return {
        index: served.bytes_for(0).device
        for index, served in servable_chunks(runtime.groups, runtime.layout).items()
    }


def check_smallest_plan_fits(
    runtime: Runtime, settings: Settings, budget: int, widest: int, served: dict[int, int]
) -> None:
    """Refuse at attach, before any update, a budget below what the smallest plan needs for the
    model states alone (every chunk offloaded, the fewest buffers, no activations yet;
    ``served``: as for ``model_state_peak``)."""
    n_persist = settings.n_persist or 0
    n_buffer = settings.n_buffer or widest
    floor = model_state_peak(runtime.layout.chunks, n_persist, n_buffer, served)
    if budget >= floor:
        return
    given = "AUTOOFFLOAD_BUDGET" if settings.budget is not None else "the device's free memory"
    suggested = f"{math.ceil(floor / (1 << 20))}MiB"
    raise PlanError(
        f"{given} gives the device {format_bytes(budget)}, below the {format_bytes(floor)} the"
        f" model's weights alone take in the smallest plan (n_persist={n_persist},"
        f" n_buffer={n_buffer}), before any activations; set AUTOOFFLOAD_BUDGET well above"
        f" {suggested} (activations come on top), or to a fraction of the device such as 0.9"
    )


def profiling_buffers(
    runtime: Runtime, n_persist: int, widest: int, budget: int | None, served: dict[int, int]
) -> int:
    """Chunk buffers of the profiling steps: two blocks' chunks (one block's copy overlaps the
    block before), or one block's where two would take more than half the budget with the
    persistent chunks: under a tight cap the profiled batch's activations need the rest (8B LoRA
    under 2.5 GiB: four 416 MiB buffers set the run's peak, two of them the planned steps').
    ``served``: as for ``model_state_peak``."""
    if budget is None:
        return 2 * widest
    two_blocks = model_state_peak(runtime.layout.chunks, n_persist, 2 * widest, served)
    return 2 * widest if two_blocks <= budget // 2 else widest


def initial_plan(runtime: Runtime, settings: Settings) -> Plan:
    """The plan used until the profiler has measured the real batch."""
    chunks = runtime.layout.chunks
    n_chunks = len(chunks)
    chunk_size = runtime.layout.chunk_size
    widest = max((len(v) for v in runtime.layout.chunks_of_group.values()), default=1)
    if settings.n_buffer is not None and settings.n_buffer < widest:
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
    served = served_device_bytes(runtime)
    if budget is not None:
        check_smallest_plan_fits(runtime, settings, budget, widest, served)
    n_buffer = settings.n_buffer
    if n_buffer is None:
        n_buffer = profiling_buffers(runtime, n_persist, widest, budget, served)
    return Plan(
        chunk_size=chunk_size,
        n_chunks=n_chunks,
        n_persist=n_persist,
        n_buffer=n_buffer,
        budget_bytes=budget,
        predicted_peak_bytes=model_state_peak(chunks, n_persist, n_buffer),
        bottleneck="not profiled yet (model states only)",
        source=source,
    )


def optim_step_bytes(
    optimizer: torch.optim.Optimizer | None, dtype: torch.dtype, device: torch.device
) -> int:
    """Transient device bytes per persistent trainable element while ``optimizer`` steps. torch's
    foreach implementations (its default on CUDA unless ``fused`` or ``foreach=False``) build
    whole-group temporaries: Adam-family the sqrt of ``exp_avg_sq`` (one state element), SGD
    the weight-decayed gradients. Fused and per-tensor kernels, and optimizers outside
    torch.optim (bitsandbytes 8-bit), count none: they hold at most one tensor's worth."""
    if optimizer is None or not type(optimizer).__module__.startswith("torch.optim"):
        return 0
    groups = optimizer.param_groups
    if any(g.get("fused") for g in groups) or device.type != "cuda":
        return 0
    if all(g.get("foreach") is False for g in groups):
        return 0
    element = torch.empty((), dtype=dtype).element_size()
    if type(optimizer).__name__ == "SGD":
        return element if any(g.get("weight_decay", 0) for g in groups) else 0
    return element


def optim_state_bytes(optimizer: torch.optim.Optimizer | None, dtype: torch.dtype) -> int:
    """GPU optimizer-state bytes per persistent trainable element (torch keeps states in the
    param dtype): Adam-family 2 states, SGD with momentum / Adagrad / RMSprop 1; bitsandbytes
    8-bit optimizers one byte per state."""
    element = torch.empty((), dtype=dtype).element_size()
    if optimizer is None:
        return 2 * element
    name = type(optimizer).__name__
    if name.endswith("8bit"):  # bitsandbytes: one byte per state (block scales are ~1%)
        return 2 if "Adam" in name else 1
    if name in ("Adam", "AdamW", "Adamax", "NAdam", "RAdam"):
        return 2 * element
    if name == "SGD":
        return element if any(g.get("momentum", 0) for g in optimizer.param_groups) else 0
    return element


def search_request(
    runtime: Runtime,
    profile: ModelProfile,
    cpu_optim_rate: float | None = None,
    budget: int | None = None,
    pinned: dict[str, int] | None = None,
    accumulate_rate: float | None = None,
) -> SearchRequest:
    """What to search for the measured ``profile``: hardware, budget and the fixed knobs (the
    user's, the activation mode's, and ``pinned`` unless the user fixed them).
    ``accumulate_rate``: gradient elements the CPU worker added per second (accumulation).

    ``budget``: bytes to plan for instead of the settings' (the OOM retry's smaller one);
    ``pinned``: knobs held at these values unless the user fixed them."""
    settings = runtime.settings
    fixed: dict[str, int] = dict(pinned or {})
    for knob in ("n_persist", "n_buffer", "n_swap", "n_checkpoint"):
        value = getattr(settings, knob)
        if value is not None:
            fixed[knob] = value
    n_blocks = profile.n_blocks
    mode = settings.activation_mode
    if mode in ("keep", "off"):
        fixed.update(n_swap=0, n_checkpoint=0)
    elif mode in ("checkpoint", "checkpoint_cpu"):
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
    if accumulate_rate is not None:
        hw = replace(hw, cpu_accumulate_params_per_s=accumulate_rate)
    sharding = runtime.manager.sharding
    if sharding is not None:
        # The measured rate is this rank's, over its own share of the params.
        hw = sharding.effective_hardware(hw)
    if runtime.data_parallel is not None:
        hw = runtime.data_parallel.effective_hardware(hw)  # gradients: collective, then D2H
    if budget is None:
        budget = budget_bytes(settings, runtime.device)
        if budget is not None and runtime.device.type == "cuda":
            # Headroom for what the model does not see: allocator growth at the cap costs a
            # cudaFree + synchronize per retry, far more than the memory it saves.
            budget -= max(BUDGET_MARGIN_MIN, int(BUDGET_MARGIN_SHARE * budget))
    swapper = runtime.activations.swapper
    held = swapper.pool.allocated_bytes if swapper else 0
    room = host_room_for_activations(held, runtime.local_ranks)
    where, host_blocks = _inputs_where_they_fit(runtime, profile, room)
    return SearchRequest(
        {profile.chunk_size: profile},
        hw,
        budget,
        fixed,
        checkpoint_inputs=where,
        host_input_blocks=host_blocks,
        host_room=room,
    )


def _inputs_where_they_fit(
    runtime: Runtime, profile: ModelProfile, room: int | None
) -> tuple[str, int | None]:
    """The search's ``checkpoint_inputs`` (``checkpoint_inputs_choice``) and the most leading
    blocks whose inputs the host's ``room`` holds (``host_room_for_activations``; None: all).
    On ``auto`` a host short of room takes the first blocks' inputs only, or none; on ``cpu``
    (every checkpointed input on the host) it is an error before the plan runs. Swapped blocks
    share the room: the search bounds both together (``SearchRequest.host_room``)."""
    chosen = checkpoint_inputs_choice(runtime.settings, runtime.device)
    if chosen == "gpu":
        return chosen, None
    need = sum(u.act_bytes_checkpoint for u in profile.blocks)
    if room is None or need <= room:
        return chosen, None
    if chosen == "cpu":
        raise PlanError(
            f"checkpoint_inputs=cpu: the checkpointed blocks' inputs take {format_bytes(need)},"
            f" more than the {format_bytes(room)} of host memory available for them; set"
            " AUTOOFFLOAD_CHECKPOINT_INPUTS=auto or gpu, or shorten the batch"
        )
    fits, total = 0, 0
    for unit in profile.blocks:
        total += unit.act_bytes_checkpoint
        if total > room:
            break
        fits += 1
    logger.info(
        "the checkpointed blocks' inputs (%s) exceed the host memory available for them (%s):"
        " the host may keep the first %d blocks' inputs, the device the rest",
        format_bytes(need),
        format_bytes(room),
        fits,
    )
    return ("auto", fits) if fits else ("gpu", None)


def checkpoint_inputs_choice(settings: Settings, device: torch.device) -> str:
    """The search's ``checkpoint_inputs``: the activation mode's or the setting's choice; ``auto``
    searches host-side inputs on a CUDA device only (on the CPU they would not leave it)."""
    if settings.activation_mode == "checkpoint_cpu":
        return "cpu"
    if settings.activation_mode == "checkpoint":
        return "gpu"
    chosen = settings.checkpoint_inputs
    return "gpu" if chosen == "auto" and device.type != "cuda" else chosen


def profile_for_plan(profile: ModelProfile, plan: Plan, hw: HardwareProfile) -> ModelProfile:
    """``profile`` in the variant ``plan`` was predicted on: the served chunks gathered whole
    when the plan serves none (``with_served_chunks_gathered``), its MLPs tiled as the plan
    tiles them, checkpointed blocks' inputs in host memory when the plan chose that
    (``checkpoint_cpu``), the measured profile otherwise;
    gradient accumulation where the plan sums it (``configuration.with_accumulation_of``)."""
    profile = with_accumulation_of(profile, plan)
    if serves_chunks(profile) and not plan.host_served_chunks:
        profile = with_served_chunks_gathered(profile, hw)
    if plan.mlp_tile_tokens:
        profile = with_mlp_tiles(profile, plan.mlp_tile_tokens)
    if "checkpoint_cpu" in plan.block_policies:
        return with_checkpoint_inputs_on_cpu(profile, hw, plan.host_input_blocks or None)
    return profile


def plan_from_profile(
    runtime: Runtime,
    profile: ModelProfile,
    cpu_optim_rate: float | None = None,
    budget: int | None = None,
    pinned: dict[str, int] | None = None,
) -> Plan:
    """Search the plan for the measured ``profile`` under the budget (see ``search_request``)."""
    return search_request(runtime, profile, cpu_optim_rate, budget, pinned).plan()


def hardware_profile(runtime: Runtime) -> HardwareProfile:
    """The machine's measured profile (cached per machine in ``settings.cache_dir``).

    Under data parallelism every rank measures at once, probe by probe (the rates of a host
    its ranks share), or every rank reads the cache: a rank missing it makes all measure."""
    optimizer = runtime.cpu_optim.optimizer
    cls = type(optimizer) if optimizer is not None else torch.optim.AdamW
    pinned = runtime.manager.host.pinned or not runtime.manager.is_cuda
    reprofile = runtime.settings.reprofile or reprofile_forced()
    dp = runtime.data_parallel
    local_ranks, barrier = 1, None
    if dp is not None:
        local_ranks, barrier = local_world_size(), dp.barrier
        cache_dir = runtime.settings.cache_dir
        cached = cached_hardware(runtime.device, cache_dir, cls, pinned, local_ranks)
        reprofile = any(dp.gather_object(reprofile or cached is None))
    return measure_hardware(
        runtime.device,
        runtime.settings.cache_dir,
        reprofile=reprofile,
        optimizer_cls=cls,
        pinned=pinned,
        local_ranks=local_ranks,
        barrier=barrier,
    )


def step_profile(
    runtime: Runtime, profiler: StepProfiler, optimizer: torch.optim.Optimizer
) -> ModelProfile:
    """The profile of the step ``profiler`` watched (runs its probes), with the optimizer's
    state and step temporaries per parameter."""
    dtype = runtime.weight_dtype()
    return profiler.build(
        optim_bytes_per_param=optim_state_bytes(optimizer, dtype),
        micro_batches=runtime.step_state.backwards_this_step,
        optim_step_bytes=optim_step_bytes(optimizer, dtype, runtime.device),
    )


def accumulate_mode(runtime: Runtime) -> str:
    """``ModelProfile.accumulate_on`` for this run: the ``accumulate_on`` setting where
    accumulation on the GPU can run (auto: "auto" on a CUDA device, "cpu" elsewhere), "cpu"
    where it cannot and the setting is auto, and a clear error where the setting asks for it
    and it cannot."""
    setting = runtime.settings.accumulate_on
    if setting == "cpu":
        return "cpu"
    problem = accumulate_on_gpu_problem(runtime)
    if problem is None:
        if setting is None:
            return "auto" if runtime.manager.is_cuda else "cpu"
        return "gpu"
    if setting is None:
        return "cpu"
    raise PlanError(
        f"AUTOOFFLOAD_ACCUMULATE_ON=gpu asks for gradient accumulation on the GPU, but {problem};"
        " set it to cpu or auto"
    )


def accumulate_on_gpu_problem(runtime: Runtime) -> str | None:
    """Why the GPU cannot sum offloaded gradients over micro-batches here (None: it can). It
    adds them into the pinned staging, which must be the host gradient itself."""
    if runtime.data_parallel is not None:
        return (
            "data parallelism averages each backward's offloaded gradients on their way out"
            " (one process only)"
        )
    cpu_optim = runtime.cpu_optim
    for _chunk, slot in cpu_optim.offloaded_slots():
        master = cpu_optim.masters.get(id(slot.param))
        if master is not None and master.dtype != slot.dtype:
            return (
                f"fp32 master weights (AUTOOFFLOAD_MASTER_WEIGHTS) keep {slot.name}'s host"
                f" gradient in {master.dtype}, not the {slot.dtype} the device sums"
            )
    return None


def gpu_update_in_backward_mode(runtime: Runtime) -> int:
    """``ModelProfile.gpu_update_in_backward`` for this run (``gpu_update_mode``'s rules); the
    cost model reads it only under the update in the backward."""
    return _gpu_path_mode(
        runtime,
        runtime.settings.gpu_update_in_backward,
        "AUTOOFFLOAD_GPU_UPDATE_IN_BACKWARD",
        "in the backward",
        None,
        in_backward=True,
    )


def gpu_update_mode(runtime: Runtime) -> int:
    """``ModelProfile.gpu_update`` for this run: the ``gpu_update_chunks`` setting where the GPU
    update path can run (auto: -1 on a CUDA device), 0 where it cannot (auto), and a clear
    error where the setting asks for it and it cannot."""
    problem = None
    if runtime.backward_update.on:
        problem = "AUTOOFFLOAD_UPDATE_IN_BACKWARD updates every chunk on the CPU"
    return _gpu_path_mode(
        runtime, runtime.settings.gpu_update_chunks, "AUTOOFFLOAD_GPU_UPDATE_CHUNKS", "", problem
    )


def _gpu_path_mode(
    runtime: Runtime,
    setting: int | None,
    env: str,
    where: str,
    problem: str | None,
    in_backward: bool = False,
) -> int:
    """A GPU update path's profile value: ``setting`` (None: auto, -1) where the path can run,
    0 where it cannot and the setting is auto, else a ``PlanError`` naming ``env``."""
    if setting == 0:
        return GPU_UPDATE_OFF
    if problem is None and not runtime.manager.is_cuda and setting is None:
        problem = "the model is not on a CUDA device"
    if problem is None:
        for optimizer in runtime.cpu_optim.optimizers:
            problem = runtime.cpu_optim.gpu_path_problem(optimizer, in_backward)
            if problem is not None:
                break
    if problem is None:
        return GPU_UPDATE_AUTO if setting is None else setting
    if setting is None:
        return GPU_UPDATE_OFF
    raise PlanError(
        f"{env}={setting} asks for GPU updates of offloaded chunks{' ' + where if where else ''},"
        f" but {problem}; set it to 0 (CPU only) or auto"
    )
