"""Runtime: wires blocks, chunks, the chunk manager and the CPU optimizer for one model."""

from __future__ import annotations

import functools
import weakref
from dataclasses import replace

import torch
from torch import nn

from autooffload.errors import AttachError, DetachStateError
from autooffload.log import logger, warn_once
from autooffload.plan.profile_types import ModelProfile
from autooffload.plan.search import Candidates, SearchRequest
from autooffload.plan.types import Plan, format_bytes
from autooffload.runtime import allocator
from autooffload.runtime.activations.fused_head import FusedHead
from autooffload.runtime.activations.model_activations import ModelActivations
from autooffload.runtime.attachable import install_copy_guard, remove_copy_guard
from autooffload.runtime.blocks import discover_groups
from autooffload.runtime.chunks.store import ChunkManager
from autooffload.runtime.control.controller import PlanControl
from autooffload.runtime.control.host_need import (
    check_host_memory,
    host_memory_now,
    host_room_for_activations,
)
from autooffload.runtime.control.oom import OomRetry
from autooffload.runtime.control.planning import (
    accumulate_mode,
    budget_bytes,
    checkpoint_inputs_choice,
    initial_plan,
)
from autooffload.runtime.hooks import StepHooks
from autooffload.runtime.host_vocab import HostVocab
from autooffload.runtime.parallel.distributed import attach_data_parallel, local_world_size
from autooffload.runtime.parallel.sharding import Sharding, fetch_offloaded
from autooffload.runtime.placement import (
    chunk_layout,
    host_param_bytes,
    on_every_rank,
    place_on_device,
    resident_trainable_params,
    return_from_device,
)
from autooffload.runtime.quantized import QuantizedParams
from autooffload.runtime.state import (
    ModelStateHooks,
    adopt_existing_state,
    load_offloaded_state,
    twin_states,
)
from autooffload.runtime.step_state import StepState
from autooffload.runtime.update.cpu_optimizer import CpuOptimizer
from autooffload.runtime.update.update_mode import BackwardUpdateMode
from autooffload.settings import Settings


class Runtime:
    """Chunked weight offload for one model: hooks gather a group's chunks before it runs,
    prefetch the next group's, release them after, and send offloaded gradients to the CPU."""

    def __init__(
        self,
        model: nn.Module,
        settings: Settings,
        device: torch.device,
        allocator_hold: bool = False,
    ) -> None:
        self.model = model
        self.settings = settings
        self.device = device
        # Whether the device allocations use expandable segments (runtime/allocator.py; the
        # hold is taken by ``runtime.attach`` and given back at detach).
        self.expandable_segments = device.type == "cuda" and allocator.active(
            settings.expandable_segments
        )
        # Whether this runtime holds the allocator setting (``allocator.acquire``), given back
        # at detach.
        self._allocator_hold = allocator_hold
        self.groups = discover_groups(model)
        if not any(g.is_block for g in self.groups):
            logger.debug("no repeated blocks found; every module with parameters is a group")
        # bitsandbytes params' quant-state tensors, laid into the chunk right after their param.
        self.quantized = QuantizedParams.collect(model.modules())
        self.resident_params = resident_trainable_params(model, self.quantized)
        self.layout = chunk_layout(
            self.groups, self.resident_params, self.quantized, settings.chunk_size
        )
        self.control = PlanControl(self, initial_plan(self, settings))
        # Read before the first collective, so before any rank allocates its host store.
        memory = host_memory_now()
        # Under torchrun: rank 0's plan on every rank, same layout and settings checked.
        self.data_parallel = attach_data_parallel(self, settings)
        # Ranks sharing this host's memory.
        self.local_ranks = 1 if self.data_parallel is None else local_world_size()
        # An explicit oom_retry=True only: auto (None) leaves the retry off in this mode.
        if settings.update_in_backward is True and settings.oom_retry:
            raise AttachError(
                "AUTOOFFLOAD_UPDATE_IN_BACKWARD=1 excludes AUTOOFFLOAD_OOM_RETRY=1 (a retried"
                " backward would update twice): set one of them to 0"
            )
        sharding = Sharding.create(settings, self.data_parallel, self.layout)
        on_every_rank(
            self.data_parallel,
            lambda: check_host_memory(
                self.layout,
                self.plan.n_persist,
                settings,
                host_param_bytes(model),
                memory,
                hosts=None if sharding is None else sharding.hosts,
                local_ranks=self.local_ranks,
            ),
        )
        self.manager = ChunkManager(
            self.layout,
            device,
            persistent=range(self.plan.n_persist),
            n_buffer=self.plan.n_buffer,
            pin_memory=True,
            sharding=sharding,
            chunk_pool=settings.chunk_pool,
        )
        self.manager.grads.set_data_parallel(self.data_parallel)
        if self.data_parallel is not None:
            # The planner's NCCL time: one chunk's gradient collective, as the backward runs it.
            self.data_parallel.measure_gradient_collective(
                max(c.trainable_bytes for c in self.layout.chunks),
                sharded=self.manager.sharding is not None,
            )
        place_on_device(
            model, self.manager, self.quantized, self.resident_params, self.data_parallel
        )
        self.cpu_optim = CpuOptimizer(self.manager, settings.master_weights, settings.cpu_threads)
        if settings.accumulate_on == "gpu":
            accumulate_mode(self)  # a clear error now where it cannot run
        self._assign_gpu_updates(self.plan)
        self.backward_update = BackwardUpdateMode(self)
        # The optimizers bound to this model, held weakly (``optimizers``): one the script
        # replaced and no longer references is freed, with its CPU twins' state.
        self._optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        self.step_state = StepState()
        # Chunks served from the host store (a frozen embedding's rows, a frozen head's tiles):
        # never gathered or prefetched by the hooks.
        self.host_vocab = HostVocab(
            self.groups,
            self.layout,
            self.manager,
            enabled=self.data_parallel is None and self.manager.sharding is None,
        )
        self.activations = ModelActivations(
            model,
            self.groups,
            device,
            settings.activation_mode,
            self.position,
            host_inputs=checkpoint_inputs_choice(settings, device) != "gpu",
            # Not a lambda over ``self``: that would be a cycle through the runtime.
            host_room=functools.partial(host_room_for_activations, local_ranks=self.local_ranks),
        )
        self.hooks = StepHooks(self)
        # The LM head fused with the loss where the logits would not fit (activations/fused_head).
        self.fused_head = FusedHead(model, settings.fused_head, budget_bytes(settings, device))
        # The profiling steps serve every frozen vocabulary chunk from the host (the least
        # device memory); the searched plan weighs serving against gathering.
        self.control.adopt_plan(
            replace(self.plan, host_served_chunks=self.host_vocab.eligible(self.plan.n_persist))
        )
        self.host_vocab.serve(self.plan.host_served_chunks)
        self.activations.start()
        # The plan is searched from profiling steps unless the user fixed it.
        profiling = settings.n_persist is None or settings.activation_mode == "auto"
        self.hooks.install()
        install_copy_guard(model)
        # state_dict / load_state_dict see and set the weights wherever they live (removed on
        # detach).
        self._state_handles = ModelStateHooks(self).install()
        # A device OOM inside the model's forward or backward is retried once
        # (runtime/control/oom.py; on by default, off with AUTOOFFLOAD_UPDATE_IN_BACKWARD=1
        # unless set explicitly; its auto mode keeps it, ``BackwardUpdateMode.note_forward``).
        self.oom = OomRetry(self).install() if settings.oom_retry_on else None
        if profiling:
            self.control.start_profiling()
            logger.debug("%s", self.plan.summary(self.device.type))
            # Two: a warm-up step that pays one-time costs, then the measured one; one where
            # the first is long (PlanControl.profile_after_step).
            logger.info(
                "attached %s: %d chunks of %s; the next 2 optimizer steps (1 if the first takes"
                " 20 s or more) are profiling steps"
                " under a conservative plan (%d chunks streamed from the host), then the plan"
                " is searched for what they measured",
                type(model).__name__,
                self.plan.n_chunks,
                format_bytes(self.plan.chunk_size),
                self.plan.n_chunks - self.plan.n_persist,
            )
        else:
            logger.info("%s", self.plan.summary(self.device.type))
        # Nothing to train at attach (Settings.offload_frozen): a reference model, a teacher.
        self.attached_frozen = not any(p.requires_grad for p in model.parameters())
        if self.attached_frozen:
            logger.info("%s", frozen_summary(self))

    # ---- plan switches ------------------------------------------------------------------------

    def apply_plan(self, plan: Plan) -> None:
        """Switch to ``plan``: persistent chunks (migrating optimizer state) and block policies."""
        served = self.host_vocab.servable_of(plan.host_served_chunks)
        new_persistent = set(range(plan.n_persist)) - served
        promoted = sorted(new_persistent - self.manager.persistent)
        demoted = sorted(self.manager.persistent - new_persistent)
        self.cpu_optim.wait()
        for index in promoted:
            self.cpu_optim.promote_chunk(self.layout.chunks[index], self.device)
        # Demoted chunks' bytes are written back to the host store here (their owner's).
        self.manager.set_persistent(sorted(new_persistent), plan.n_buffer)
        self._slot_cache = None
        if demoted:
            self._demote(demoted)
        self._assign_gpu_updates(plan)
        self.activations.apply_plan(plan)
        self.host_vocab.serve(served)
        self.control.adopt_plan(plan)

    def _demote(self, indices: list[int]) -> None:
        """Chunks leave the GPU (a calibration found the plan does not fit): the CPU optimizer
        takes their params, and their optimizer state moves from the user's optimizers to the
        CPU twins (under sharded state to the owner's; the other ranks drop their replica of
        it, which is the same)."""
        for index in indices:
            self.cpu_optim.demote_chunk(self.layout.chunks[index])
        for optimizer in self.optimizers:
            if not any(o is optimizer for o in self.cpu_optim.optimizers):
                # Bound before any of its params was offloaded: it gets twins now.
                self.cpu_optim.bind(optimizer)
            adopt_existing_state(self, optimizer)

    def _assign_gpu_updates(self, plan: Plan) -> None:
        """The offloaded chunks the GPU updates (plan/update_split.py): the last k at
        ``step()``; under the update in the backward, the lowest kb there. A plan fixed by
        the user is never searched: a fixed kb applies as set."""
        k = plan.gpu_update_chunks
        trainable = [c.index for c in self.layout.chunks[plan.n_persist :] if c.trainable_slots]
        kb = plan.gpu_backward_chunks
        if not plan.predicted:
            kb = self.settings.gpu_update_in_backward or 0
        # Gradient accumulation's sums: where the search put them; a plan not searched (the
        # first steps, a fixed plan) follows the setting.
        if plan.predicted:
            accumulate_on_gpu = plan.accumulates_on_gpu
        else:
            accumulate_on_gpu = self.settings.accumulate_on == "gpu"
        self.cpu_optim.place(
            at_step=set(trainable[len(trainable) - k :]) if k else set(),
            in_backward=set(trainable[:kb]),
            accumulate_on_gpu=accumulate_on_gpu,
        )

    def position(self, group_index: int) -> int:
        """Where group ``group_index`` ran in the last complete forward."""
        return self.hooks.position(group_index)

    def weight_dtype(self) -> torch.dtype:
        """The floating dtype holding most chunk bytes (packed quantized bytes are no dtype
        the compute or the optimizer uses)."""
        sizes: dict[torch.dtype, int] = {}
        for chunk in self.layout.chunks:
            for slot in chunk.slots:
                if slot.dtype.is_floating_point:
                    sizes[slot.dtype] = sizes.get(slot.dtype, 0) + slot.nbytes
        return max(sizes, key=sizes.__getitem__) if sizes else torch.float32

    # ---- optimizer integration ------------------------------------------------------------

    def owns(self, param: torch.Tensor) -> bool:
        """Whether ``param`` lives in one of this runtime's chunks."""
        return id(param) in self.slot_index

    def manages(self, param: torch.Tensor) -> bool:
        """Whether this runtime placed ``param`` (chunked or resident)."""
        return self.owns(param) or any(p is param for p in self.resident_params)

    @property
    def slot_index(self) -> dict:
        """Per chunked param's id: its chunk and slot (``ChunkLayout.slot_of``), made once."""
        cached = getattr(self, "_slot_cache", None)
        if cached is None:
            cached = self.layout.slot_of()
            self._slot_cache = cached
        return cached

    def is_offloaded(self, param: torch.Tensor) -> bool:
        entry = self.slot_index.get(id(param))
        return entry is not None and entry[0].index not in self.manager.persistent

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The bound optimizers that still exist, in binding order."""
        return [o for ref in self._optimizers if (o := ref()) is not None]

    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer`` holds params of this model: its steps drive the runtime's steps and,
        for its offloaded params, the CPU update. Others bound before it keep theirs: each
        steps the params it holds with its own state, as in plain PyTorch."""
        self._optimizers = [ref for ref in self._optimizers if ref() is not None]
        if any(o is optimizer for o in self.optimizers):
            return
        self._optimizers.append(weakref.ref(optimizer))
        self.cpu_optim.bind(optimizer)
        adopt_existing_state(self, optimizer)

    def adopt_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """The state bound ``optimizer`` holds for offloaded params (made after it was bound)
        moves to the CPU twins."""
        adopt_existing_state(self, optimizer)

    def rebind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer`` changed its param groups (``add_param_group``): mirror them again,
        keeping the state the twins hold."""
        states = twin_states(self, optimizer)
        self.cpu_optim.bind(optimizer)
        load_offloaded_state(self, optimizer, states, replace=False)
        adopt_existing_state(self, optimizer)

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The user's optimizer is about to step: clean up after an interrupted forward or
        backward, and before the run's first update check that a plan fits the budget."""
        self.hooks.recover_interrupted()
        self.hooks.offload_assigned_grads()
        self.control.before_update(optimizer)
        self.control.calibration.device_update_starts(optimizer)

    def after_step(self, optimizer: torch.optim.Optimizer, apply_update: bool = True) -> None:
        """The user's optimizer stepped the GPU params; queue the CPU update of the rest
        (none when ``apply_update`` is False: a step skipped for non-finite gradients)."""
        self.control.calibration.device_update_ends(apply_update)
        self.backward_update.observe(optimizer, self.step_state.backwards_this_step)
        self.cpu_optim.early.settle_persistent(optimizer)
        profile = self.control.profile_after_step(optimizer)
        updated = apply_update and any(o is optimizer for o in self.cpu_optim.optimizers)
        if updated:
            self.cpu_optim.step(optimizer)
        self.control.after_update(profile, updated)
        backwards = self.step_state.end_step()
        sharding = self.manager.sharding
        if apply_update and sharding is not None:
            sharding.drop_consolidated()  # other ranks' chunks are stale now
        self.manager.fold_copy_times()
        self.control.end_step(backwards)
        self.backward_update.end_step(self.oom.input_numel if self.oom is not None else 0)

    def hook_ids(self) -> set[int]:
        """The ids of every hook this runtime registered on the model's modules (the step hooks
        and the state-dict hooks)."""
        return self.hooks.hook_ids() | {handle.id for handle in self._state_handles}

    @property
    def last_trace(self) -> list[int]:
        """Group indices in the order the last complete forward ran them."""
        return self.hooks.last_trace

    @property
    def allocator_hold(self) -> bool:
        """Whether this runtime holds the allocator setting until it detaches."""
        return self._allocator_hold

    @property
    def plan(self) -> Plan:
        """The running plan."""
        return self.control.plan

    @property
    def profile(self) -> ModelProfile | None:
        """The profile the running plan was searched on (calibrated since), None before one."""
        return self.control.profile

    @property
    def search_request(self) -> SearchRequest | None:
        """The search behind the running plan."""
        return self.control.search_request

    @property
    def plan_settled(self) -> bool:
        """The searched plan runs and its first checks against the measurement are over (no
        profiling step and no first-round calibration pending): the steady state, which a
        benchmark times."""
        return self.control.settled

    @property
    def steps_taken(self) -> int:
        """Optimizer steps seen since attach (a consolidated state is valid until the next)."""
        return self.step_state.steps

    def candidates(self) -> Candidates | None:
        """Every feasible configuration of the search the profiled plan came from (this rank's
        profile and budget), or None before that plan; re-runs the search, no profiling."""
        return self.search_request.candidates() if self.search_request is not None else None

    def zero_grad(self, set_to_none: bool = True, param_ids: set[int] | None = None) -> None:
        """Clear the host gradients of ``param_ids`` (None: every offloaded param)."""
        self.hooks.recover_interrupted()
        self.cpu_optim.zero_grad(set_to_none, param_ids)
        self.step_state.cleared()

    def host_grads(self) -> list[torch.Tensor]:
        self.cpu_optim.wait()
        return self.cpu_optim.grad_norms.host_grads()

    def synchronize(self) -> None:
        self.cpu_optim.wait()
        self.manager.synchronize()

    def stats(self) -> dict[str, float]:
        self.manager.fold_copy_times(wait=True)
        peak = torch.cuda.max_memory_allocated(self.device) if self.manager.is_cuda else 0
        retries = (
            torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)
            if self.manager.is_cuda
            else 0
        )
        return {
            "steps": self.step_state.steps,
            "h2d_bytes": self.manager.stats["h2d_bytes"],
            "d2h_bytes": self.manager.stats["d2h_bytes"],
            "h2d_s": self.manager.stats["h2d_s"],
            "d2h_s": self.manager.stats["d2h_s"],
            "gather_s": self.manager.stats["gather_s"],
            "broadcast_bytes": self.manager.stats["broadcast_bytes"],
            "cpu_optim_s": self.cpu_optim.busy_s,
            "cpu_updates_in_backward": self.cpu_optim.updates_in_backward,
            "stall_s": self.manager.stats["stall_s"],
            "peak_bytes": peak,
            "alloc_retries": retries,
            "cpu_update_params_per_s": (
                self.cpu_optim.updated_params / self.cpu_optim.update_s
                if self.cpu_optim.update_s
                else 0.0
            ),
            # The GPU update path (runtime/update/gpu_update.py): host seconds issuing it, elements.
            "gpu_update_s": self.cpu_optim.gpu.busy_s,
            "gpu_update_params": self.cpu_optim.gpu.updated_params,
        }

    # ---- teardown -------------------------------------------------------------------------

    def detach(self, device: torch.device | str | None = None) -> nn.Module:
        """Return the ordinary model, trained weights on ``device`` (default: the attach device)."""
        target = torch.device(device) if device is not None else self.device
        if self.cpu_optim.early.count:
            warn_once(
                "detach-early-updates",
                f"autooffload: {self.cpu_optim.early.count} chunks were updated in a"
                " backward that no optimizer.step() followed (an interrupted one, or one the loop"
                " stopped after), and the returned weights include that part of a step;"
                " AUTOOFFLOAD_UPDATE_IN_BACKWARD=0 leaves such steps without any update",
            )
        self.cpu_optim.wait()
        # A collective under sharding (every rank detaches): the chunks other ranks own.
        fetched = fetch_offloaded(self, None)
        self.hooks.remove()
        for handle in self._state_handles:
            handle.remove()
        self._state_handles = []
        remove_copy_guard(self.model)
        if self.oom is not None:
            self.oom.remove()
        self.activations.remove()
        self.host_vocab.stop()
        self.fused_head.remove()
        return_from_device(
            self.model, self.manager, self.quantized, self.resident_params, target, fetched
        )
        try:
            # The user's optimizer keeps training the returned model: the offloaded params'
            # state (in the CPU twins) becomes its own, as when a re-plan promotes a chunk. Done
            # once the model is whole, so a state that does not fit leaves a correct model.
            for chunk in self.manager.chunks:
                if chunk.index not in self.manager.persistent:
                    self.cpu_optim.promote_chunk(chunk, target)
        except torch.OutOfMemoryError as error:
            raise DetachStateError(
                f"the model is detached on {target}, but the optimizer state of its offloaded"
                f" parameters does not fit there ({str(error).splitlines()[0][:120]}); detach to"
                " the CPU instead (autooffload.runtime.detach(model, 'cpu')) to keep training"
                " with this optimizer, or build a new optimizer for the returned model"
            ) from None
        finally:
            self.cpu_optim.shutdown()
            self.activations.release_swapper()
            self.control.close()
            self.backward_update.close()
            allocator.release(self._allocator_hold)
            self._allocator_hold = False
        return self.model


def frozen_summary(runtime: Runtime) -> str:
    """The line logged when a model with nothing to train attaches (a reference model, a
    teacher: ``Settings.offload_frozen``): where its weights are while it runs under no_grad."""
    plan = runtime.plan
    offloaded = runtime.layout.chunks[plan.n_persist :]
    gib = sum(c.nbytes for c in offloaded) / (1 << 30)
    return (
        f"frozen {type(runtime.model).__name__} (nothing to train): {len(offloaded)} of"
        f" {plan.n_chunks} chunks ({gib:.2f} GiB) streamed from pinned CPU through"
        f" {plan.n_buffer} GPU buffers in every forward; it is planned like a trained model"
        " if something in it trains (AUTOOFFLOAD_OFFLOAD_FROZEN=0 keeps such models whole)"
    )
