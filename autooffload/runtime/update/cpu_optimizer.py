"""CPU side of the split optimizer: fp32 masters, host gradients and a worker thread.

The user's optimizer stays the user's object and updates the persistent (GPU) parameters
itself: offloaded parameters carry no ``.grad`` on the GPU at step time, so torch optimizers
skip them. For every offloaded trainable parameter this module keeps an fp32 master (or uses
the host copy itself when the model is fp32, or when master weights are off), accumulates its
gradients as they arrive from the GPU, and at ``optimizer.step()`` updates it with a CPU twin
of the user's optimizer class, whose hyperparameters are copied from the user's
``param_groups`` at every step so LR schedulers keep working. The work runs on one worker
thread, in order: a chunk's update is queued after its gradient accumulation, and the next
forward's copy of that chunk to the GPU waits for the update (``ChunkManager.host_busy``).
"""

from __future__ import annotations

import inspect
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from autooffload import openmp
from autooffload.errors import AttachError, UpdateInBackwardError
from autooffload.runtime.chunks.layout import Chunk, ParamSlot
from autooffload.runtime.chunks.store import ChunkManager, Residency
from autooffload.runtime.update.gpu_update import GpuUpdater
from autooffload.runtime.update.host_grads import HostGradNorms
from autooffload.runtime.update.persistent_update import step_params

if TYPE_CHECKING:
    from autooffload.runtime.distributed import Reduction

# Gradient accumulation adds a micro-batch's staged gradients (the model's dtype) onto fp32
# host gradients. torch adds mixed dtypes by casting the whole staged tensor into a new fp32
# temporary first: for a 64M-element tensor that is a fresh allocation, page faults included,
# per add (16 cores: 2.1 Gparam/s, against 10 for fp32 + fp32). Views of ACCUMULATE_BLOCK
# elements keep each temporary small and reused by the allocator (devtools/host_accumulate_rate.py).
ACCUMULATE_BLOCK = 1 << 20

# torch.optim classes that run on CPU tensors; the fused CPU kernels are the fast path.
CPU_OPTIMIZERS = ("Adam", "AdamW", "SGD", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam")
FUSED_ON_CPU = ("Adam", "AdamW", "SGD", "Adagrad")


def check_optimizer_class(optimizer: torch.optim.Optimizer) -> None:
    """Raise ``AttachError`` if the optimizer's class has no CPU twin."""
    cls = type(optimizer)
    if cls.__module__.startswith("torch.optim") and cls.__name__ in CPU_OPTIMIZERS:
        return
    hint = ""
    if cls.__module__.startswith("bitsandbytes"):
        # bnb optimizers (8-bit, paged) keep their state on the GPU: they fit resident params
        # (LoRA adapters under a tenth of the model's bytes), not chunks updated on the CPU.
        hint = " (bitsandbytes optimizers update only params that stay on the GPU)"
    raise AttachError(
        f"optimizer class {cls.__module__}.{cls.__name__} has no CPU path for offloaded"
        f" parameters{hint}; use one of torch.optim.{{{', '.join(CPU_OPTIMIZERS)}}}, or keep every"
        " trainable parameter on the GPU (AUTOOFFLOAD_OFFLOAD=0, or a larger AUTOOFFLOAD_N_PERSIST)"
    )


def _twin_group(group: dict, cls: type) -> dict:
    hyper = {k: v for k, v in group.items() if k != "params"}
    for key, value in list(hyper.items()):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            hyper[key] = value.item()
    hyper["foreach"] = False
    hyper["capturable"] = False
    hyper["differentiable"] = False
    hyper["fused"] = cls.__name__ in FUSED_ON_CPU or None
    return hyper


def update_threads(setting: int | None, on_gpu: bool) -> int:
    """Threads of the CPU updates: the setting, else torch's intra-op threads, less one on a
    GPU run. The main thread launches every kernel of the forward the update overlaps; with as
    many busy OpenMP threads as cores, it and one OpenMP straggler take turns on a core, and
    both the GPU (idle between launches) and the update (waiting at each barrier) slow down."""
    if setting is not None:
        return setting
    available = torch.get_num_threads()
    return max(1, available - 1) if on_gpu and available > 2 else available


class CpuOptimizer(HostGradNorms):
    """Masters, host gradients and the CPU twin optimizers of a model's offloaded parameters."""

    def __init__(
        self, manager: ChunkManager, master_weights: bool, threads: int | None = None
    ) -> None:
        self.manager = manager
        self.master_weights = master_weights
        self.threads = update_threads(threads, manager.is_cuda)
        # OpenMP's thread count is per calling thread: set on the worker, it leaves the main
        # thread's own CPU ops as they were.
        self.worker = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="autooffload-cpu-optim",
            initializer=torch.set_num_threads,
            initargs=(self.threads,),
        )
        self.masters: dict[int, torch.Tensor] = {}
        # AUTOOFFLOAD_UPDATE_IN_BACKWARD: armed by the runtime once the plan is searched; the
        # chunks updated in this backward, with the optimizer and hyperparameters used; what
        # turned it on (named in the errors).
        self.update_in_backward = False
        self.early: dict[int, tuple[torch.optim.Optimizer, list[dict]]] = {}
        # The persistent chunks stepped on the GPU in this backward
        # (runtime/update/persistent_update.py), per chunk: each owner, the indices of its
        # groups stepped and their hyperparameters.
        self.persistent_in_backward = False
        self.persistent_early: dict[int, list[tuple[torch.optim.Optimizer, list[int], list[dict]]]]
        self.persistent_early = {}
        self.update_in_backward_origin = "AUTOOFFLOAD_UPDATE_IN_BACKWARD=1"
        # The loop as the auto mode observes it (runtime/update/update_mode.py): a backward since
        # the last step, what the loop did between a backward and its step that an update in
        # the backward could not honour, and (while ``observing``) the hyperparameters of every
        # bound optimizer when the step's first gradients arrived.
        self.backward_since_step = False
        self.loop_reasons: set[str] = set()
        self.observing = False
        self.hyper_at_backward: dict[int, list[dict]] | None = None
        self.grad_buffers: dict[int, torch.Tensor] = {}
        # Per param id, views made once: the pinned gradient staging, and the host store's
        # compute copy where the update writes a master back (none for a master that is it).
        self.staged_views: dict[int, torch.Tensor] = {}
        # Per param id: (host gradient, staging) split in ACCUMULATE_BLOCK views for the adds
        # of mixed dtypes, made once per host gradient buffer.
        self.add_views: dict[int, tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]] = {}
        # Per chunk: the worker's last task that reads or writes its host gradients (an
        # accumulation, an update), which a GPU update of them waits for; the worker runs its
        # tasks in order, so it also covers every earlier task on the chunk. Unlike
        # ``manager.host_busy`` (work on the chunk's weights or state), an accumulation does
        # not hold back the next forward's gather of the weights.
        self.grads_busy: dict[int, Future] = {}
        self.copy_back: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        # Chunks whose host gradients are their pinned staging itself (main thread's view): the
        # first backward after zero_grad needs no copy out of staging when the dtypes agree
        # (no fp32 masters). The staging is then released before it is written again
        # (``_before_staging_write``), at the update (``staging_busy``) or at zero_grad.
        self.aliased: set[int] = set()
        # Twins and their user-group indices, keyed by (chunk index, id(user optimizer)).
        self.twins: dict[tuple[int, int], torch.optim.Optimizer] = {}
        self.twin_group_index: dict[tuple[int, int], list[int]] = {}
        self.optimizers: list[torch.optim.Optimizer] = []
        self.optimizer_of_param: dict[int, torch.optim.Optimizer] = {}
        self.group_of_param: dict[int, int] = {}
        # Per param: backward passes accumulated since zero_grad, and the device-side norm of
        # the last one's gradient (the norm of the host gradient while there was only one).
        self.accumulations: dict[int, int] = {}
        self.device_norms: dict[int, torch.Tensor] = {}
        # Gradient accumulation on the GPU (the plan's ``accumulate_on_gpu``): a chunk whose
        # host gradients are its staging (``aliased``) gets the next backward's gradients added
        # to them on the device (``GradientOffload._sum_on_device``), so the worker adds nothing.
        self.accumulate_on_gpu = False
        # Params whose ``device_norms`` entry is the norm of their whole host sum (taken after
        # the device added it), which clipping can use whatever the backward count.
        self.norm_of_sum: set[int] = set()
        # Gradient clipping is applied lazily: the coefficient scales the host gradients in
        # the update task, on the worker, instead of a pass over them on the critical path.
        self.clip_coef = 1.0
        self.busy_s = 0.0
        self.update_s = 0.0
        # Gradient accumulation's adds (a micro-batch's gradients onto the earlier ones'):
        # seconds and elements, for the cost model's ``cpu_accumulate_params_per_s``.
        self.add_s = 0.0
        self.added_params = 0
        # Of those, the elements copied out of an aliased staging (``_unalias``).
        self.copied_params = 0
        # Seconds inside the twins' step() alone: against busy_s, what the kernels take and
        # what the rest (gradient copies, Python, waits for the GIL between ops) adds.
        self.kernel_s = 0.0
        self.updated_params = 0
        self.updates = 0
        # Of them, those queued in a backward (``_update_now``).
        self.updates_in_backward = 0
        # The GPU update path (runtime/update/gpu_update.py) and the chunks the plan gives it.
        self.gpu = GpuUpdater(manager)
        self.gpu_chunks: set[int] = set()
        # Under the update in the backward, the chunks the GPU updates at the end of their
        # backward, weights and gradients still resident (plan/update_split.backward_split).
        self.backward_gpu_chunks: set[int] = set()
        self._gpu_problems: dict[int, str | None] = {}
        manager.on_grads_ready = self._grads_ready
        manager.on_grads_averaging = self.update_averaged_on_device
        manager.before_staging_write = self._before_staging_write
        manager.device_sums = self.device_sums
        # Every offloaded trainable param, on every rank (masters exist only for the chunks
        # this rank owns when the state is sharded: runtime/sharding.py).
        self.offloaded_ids: set[int] = set()
        self.sharding = manager.sharding
        for chunk in manager.chunks:
            if chunk.index in manager.persistent:
                continue
            self.offloaded_ids.update(id(s.param) for s in chunk.trainable_slots)
            if self.sharding is None or self.sharding.owns(chunk.index):
                self._make_masters(chunk)

    def _make_masters(self, chunk: Chunk) -> None:
        for slot in chunk.trainable_slots:
            host = self.manager.host_view(slot, chunk)
            if self.master_weights and host.dtype != torch.float32 and host.is_floating_point():
                self.masters[id(slot.param)] = host.float()
            else:
                self.masters[id(slot.param)] = host

    def refresh_masters(self) -> None:
        """Re-read fp32 masters from the host store after its bytes were overwritten."""
        self.wait()
        for chunk, slot in self.offloaded_slots():
            master = self.masters.get(id(slot.param))
            if master is None:
                continue  # another rank's chunk (sharded state): its owner keeps the master
            host = self.manager.host_view(slot, chunk)
            if master.data_ptr() != host.data_ptr():
                master.copy_(host)

    def offloaded_slots(self) -> list[tuple[Chunk, ParamSlot]]:
        """Every trainable slot of a non-persistent chunk."""
        return [
            (chunk, slot)
            for chunk in self.manager.chunks
            if chunk.index not in self.manager.persistent
            for slot in chunk.trainable_slots
        ]

    # ---- gradients --------------------------------------------------------------------------

    def _grads_ready(
        self,
        chunk: Chunk,
        slots: list[ParamSlot],
        event: torch.cuda.Event | None,
        norms: tuple[torch.Tensor, ...] = (),
        presence: torch.Tensor | None = None,
        summed: bool = False,
    ) -> None:
        """``presence`` (data parallel): per slot, 0 where no rank had a gradient, read once
        ``event`` is done; those slots get no host gradient. ``summed``: the staging holds
        every backward's sum since zero_grad (``device_sums``): it stays the host gradient."""
        self._note_gradients(chunk)
        for slot, norm in zip(slots, norms, strict=False):
            pid = id(slot.param)
            self.accumulations[pid] = self.accumulations.get(pid, 0) + 1
            self.device_norms[pid] = norm
            if summed:
                self.norm_of_sum.add(pid)
            else:
                self.norm_of_sum.discard(pid)
        alias = summed or all(self._aliasable(slot) for slot in slots)
        if alias:
            self.aliased.add(chunk.index)
        future = self.worker.submit(self._accumulate, chunk, slots, event, alias, presence)
        self.manager.staging_busy[chunk.index] = future
        self.grads_busy[chunk.index] = future
        if self.update_in_backward:
            self._update_now(chunk)

    def device_sums(self, chunk: Chunk, slots: list[ParamSlot]) -> list[bool] | None:
        """Under GPU accumulation, for ``chunk``'s gradients about to leave the device: per
        slot, whether its host gradient (the chunk's staging, aliased since the first backward
        after zero_grad) holds a sum to add them to there; None: the worker accumulates them
        (the chunk's host gradients are not its staging, or accumulation is on the CPU)."""
        if not self.accumulate_on_gpu or chunk.index not in self.aliased:
            return None
        return [self.accumulations.get(id(slot.param), 0) > 0 for slot in slots]

    def release_staging(self) -> None:
        """A forward after a backward of this step (gradient accumulation on the CPU): queue
        the copies of aliased host gradients out of their staging now, so the worker runs them
        beside this forward, in the order the backward will need the staging again (the last
        chunk first), instead of the backward waiting for each as its gradients come out (3.6B:
        ~2B elements, a few hundred ms). Under accumulation on the GPU the staging keeps the
        sums: nothing to do."""
        if self.accumulate_on_gpu:
            return
        for index in sorted(self.aliased, reverse=True):
            self._before_staging_write(index)

    def _note_gradients(self, chunk: Chunk) -> None:
        """Gradients of ``chunk`` are in: raise if it was updated in this step's backward
        already; note the backward (and, observing, the hyperparameters now)."""
        if chunk.index in self.early:
            raise UpdateInBackwardError(
                f"a second backward reached chunk {chunk.index} before optimizer.step(), but"
                f" the update in the backward ({self.update_in_backward_origin}) already"
                " applied its update in the first: gradient accumulation needs"
                " AUTOOFFLOAD_UPDATE_IN_BACKWARD=0"
            )
        if self.observing and self.hyper_at_backward is None:
            self.hyper_at_backward = {
                id(o): [_twin_group(g, type(o)) for g in o.param_groups] for o in self.optimizers
            }
        self.backward_since_step = True

    def _device_update_owner(
        self, chunk: Chunk
    ) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer] | None:
        """(optimizer, twin) when the GPU updates ``chunk`` in this backward: the plan gives
        it the chunk, the update in the backward is armed, one bound optimizer owns it and
        the GPU path can run it; None where the chunk's gradients go to the CPU instead (which
        trains alike)."""
        if not self.update_in_backward or chunk.index not in self.backward_gpu_chunks:
            return None
        if self.clip_coef != 1.0 or chunk.index in self.manager.persistent:
            return None
        optimizer = self._sole_owner(chunk)
        if optimizer is None:
            return None
        if id(optimizer) not in self._gpu_problems:
            self._gpu_problems[id(optimizer)] = self.gpu_path_problem(optimizer, in_backward=True)
        if self._gpu_problems[id(optimizer)] is not None:
            return None
        twin = self._twin(chunk, optimizer)
        return None if twin is None else (optimizer, twin)

    def _sole_owner(self, chunk: Chunk) -> torch.optim.Optimizer | None:
        """The one bound optimizer owning every trainable param of ``chunk``; None when none
        is bound yet or several share it (an update in the backward is then left to step())."""
        owners = {self.optimizer_of_param.get(id(s.param)) for s in chunk.trainable_slots}
        return owners.pop() if len(owners) == 1 else None

    def load_state(self, chunk: Chunk) -> None:
        """The backward nears ``chunk``: if the GPU updates it there, start copying its
        optimizer state in (``GpuUpdater.load_state``)."""
        if chunk.index in self.early or chunk.index in self.gpu.loaded:
            return
        found = self._device_update_owner(chunk)
        if found is not None:
            self.gpu.load_state(chunk, found[1])

    def update_on_device(self, chunk: Chunk) -> bool:
        """``chunk``'s backward is complete: update it on the GPU now if the plan gives it
        to the GPU in the backward (``GpuUpdater.update_resident``), its gradients dropped;
        False where its gradients go to the host as usual."""
        if self.manager.state[chunk.index] != Residency.RESIDENT:
            return False
        if self.manager.data_parallel is not None:
            return False  # after the average: ``update_averaged_on_device``
        slots = [s for s in chunk.trainable_slots if s.param.grad is not None]
        found = self._device_update_owner(chunk) if slots else None
        if found is None:
            return False
        self._update_resident(chunk, *found, slots)
        for slot in slots:
            slot.param.grad = None
        return True

    def update_averaged_on_device(
        self, chunk: Chunk, grads: list[torch.Tensor], reduction: Reduction
    ) -> bool:
        """Data parallelism with sharded state, on ``chunk``'s owner: its gradients are being
        averaged into ``grads`` (views of ``reduction``'s buffers, one per trainable slot, every
        slot with a gradient here) while its weights are still resident. Update it on the GPU
        now, behind the collective, if the plan gives it the GPU in the backward (as
        ``update_on_device`` does on one process); False where its averaged gradients go to
        the host as usual."""
        found = self._device_update_owner(chunk)
        if found is None or self.manager.state[chunk.index] != Residency.RESIDENT:
            return False
        self._update_resident(
            chunk,
            *found,
            chunk.trainable_slots,
            grads=grads,
            after=reduction.wait,
            keep=reduction.flats,
        )
        return True

    def _update_resident(
        self,
        chunk: Chunk,
        optimizer: torch.optim.Optimizer,
        twin: torch.optim.Optimizer,
        slots: list[ParamSlot],
        **kwargs: Any,
    ) -> None:
        """Start ``GpuUpdater.update_resident`` of ``chunk``'s ``slots`` (``kwargs``: its
        gradients, when not their ``.grad``) as an update in this backward."""
        self._note_gradients(chunk)
        hyper = self._hyper(chunk, optimizer)
        self.early[chunk.index] = (optimizer, hyper)
        self.manager.before_host_write(chunk.index)
        pairs = [(self.masters[id(s.param)], s) for s in slots]
        future = self.gpu.update_resident(chunk, twin, hyper, pairs, **kwargs)
        self.manager.host_busy[chunk.index] = future

    def _update_now(self, chunk: Chunk) -> None:
        """Queue ``chunk``'s update right behind its gradients (ProTrain's overlap of the CPU
        update with the backward): exact when ``step()`` follows this backward with the same
        hyperparameters and nothing between them reads or scales the gradients, which
        ``step``, ``clip_``, ``host_grads`` and ``zero_grad`` check."""
        optimizer = self._sole_owner(chunk)
        if optimizer is None:
            return  # no optimizer bound yet, or several: left to step()
        twin = self._twin(chunk, optimizer)
        if twin is None or self.clip_coef != 1.0:
            return
        hyper = self._hyper(chunk, optimizer)
        self.early[chunk.index] = (optimizer, hyper)
        self._queue_update(chunk, twin, hyper, 1.0)
        self.updates_in_backward += 1

    def _hyper(self, chunk: Chunk, optimizer: torch.optim.Optimizer) -> list[dict]:
        """The user's hyperparameters for ``chunk``'s twin groups, as the twin takes them."""
        return [
            _twin_group(optimizer.param_groups[g], type(optimizer))
            for g in self.twin_group_index[(chunk.index, id(optimizer))]
        ]

    def check_no_early_update(self, what: str) -> None:
        """Raise if a chunk was updated in this backward: ``what`` needs the gradients before
        any update. Between a backward and its step, ``what`` is also a reason the loop cannot
        take the update in the backward (``loop_reasons``, for the auto mode)."""
        if self.backward_since_step:
            self.loop_reasons.add(what)
        if self.early_count:
            raise UpdateInBackwardError(
                f"{what} after a backward in which the update in the backward"
                f" ({self.update_in_backward_origin}) already updated {self.early_count}"
                " chunks with that backward's raw gradients (not unscaled by a GradScaler, not"
                " clipped); optimizer.step() applies the rest of that update, and"
                " AUTOOFFLOAD_UPDATE_IN_BACKWARD=0 suits loops that clip, use a GradScaler, skip"
                " steps or read the gradients before step()"
            )

    @property
    def early_count(self) -> int:
        """Chunks updated in this backward, offloaded and persistent."""
        return len(self.early) + len(self.persistent_early)

    def update_persistent(self, chunk: Chunk) -> None:
        """Persistent ``chunk``'s backward is complete: step its params that have a gradient
        with their optimizers now and drop the gradients (runtime/update/persistent_update.py)."""
        with_grad = [s.param for s in chunk.trainable_slots if s.param.grad is not None]
        if not with_grad:
            return
        if chunk.index in self.persistent_early:
            raise UpdateInBackwardError(
                f"gradients reached persistent chunk {chunk.index} after the update in the"
                f" backward ({self.update_in_backward_origin}) applied its update (a second"
                " backward before optimizer.step(), as gradient accumulation runs): set"
                " AUTOOFFLOAD_UPDATE_IN_BACKWARD=0"
            )
        by_owner: dict[int, tuple[torch.optim.Optimizer, set[int]]] = {}
        for param in with_grad:
            owner = self.optimizer_of_param.get(id(param))
            if owner is not None:
                by_owner.setdefault(id(owner), (owner, set()))[1].add(id(param))
        entries = []
        for owner, ids in by_owner.values():
            groups = step_params(owner, ids)
            hyper = [_twin_group(owner.param_groups[g], type(owner)) for g in groups]
            entries.append((owner, groups, hyper))
            for param in with_grad:
                if id(param) in ids:
                    param.grad = None
        if entries:
            self.persistent_early[chunk.index] = entries

    def settle_persistent(self, optimizer: torch.optim.Optimizer) -> None:
        """At ``optimizer.step()``: its persistent params were stepped in the backward (the
        step skipped them, having no gradient); raise if that used other hyperparameters."""
        for index in list(self.persistent_early):
            kept = []
            for owner, groups, hyper in self.persistent_early[index]:
                if owner is not optimizer:
                    kept.append((owner, groups, hyper))
                    continue
                now = [_twin_group(optimizer.param_groups[g], type(optimizer)) for g in groups]
                if now != hyper:
                    del self.persistent_early[index]
                    raise UpdateInBackwardError(
                        f"optimizer.step() runs with hyperparameters {now} but the update in the"
                        f" backward ({self.update_in_backward_origin}) stepped persistent chunk"
                        f" {index} during backward with {hyper}; change them before backward"
                        " (schedulers stepping after optimizer.step() do) or set"
                        " AUTOOFFLOAD_UPDATE_IN_BACKWARD=0"
                    )
            if kept:
                self.persistent_early[index] = kept
            else:
                del self.persistent_early[index]

    def note_step_hyper(self, optimizer: torch.optim.Optimizer) -> None:
        """At ``optimizer.step()`` while observing: hyperparameters changed since the step's
        first gradients arrived are a reason against the update in the backward (it would
        have used the old ones)."""
        before = (self.hyper_at_backward or {}).get(id(optimizer))
        if before is None:
            return
        now = [_twin_group(g, type(optimizer)) for g in optimizer.param_groups]
        if now != before:
            self.loop_reasons.add("hyperparameters changed between backward and optimizer.step()")

    def _aliasable(self, slot: ParamSlot) -> bool:
        """Whether ``slot``'s host gradient can be its staging: the first backward since
        zero_grad (nothing to add to) and a master of the gradient's dtype."""
        pid = id(slot.param)
        master = self.masters.get(pid)
        first = self.accumulations.get(pid) == 1
        return first and master is not None and master.dtype == slot.dtype

    def _accumulate(
        self,
        chunk: Chunk,
        slots: list[ParamSlot],
        event: torch.cuda.Event | None,
        alias: bool = False,
        presence: torch.Tensor | None = None,
    ) -> None:
        if event is not None:
            event.synchronize()
        start = time.perf_counter()
        if presence is not None:
            flags = presence.tolist()
            slots = [slot for slot, present in zip(slots, flags, strict=True) if present != 0]
        # Host gradients set from staging (a copy into the param's buffer) or added to.
        fresh_masters: list[torch.Tensor] = []
        fresh: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        added: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        added_slots: list[ParamSlot] = []
        for slot in slots:
            master = self.masters[id(slot.param)]
            staged = self._staged(slot, chunk)
            if alias:
                master.grad = staged  # read in place by the update: one pass less
            elif master.grad is None:
                fresh_masters.append(master)
                fresh[0].append(self._grad_buffer(slot, master))
                fresh[1].append(staged)
            else:
                added[0].append(master.grad)
                added[1].append(staged)
                added_slots.append(slot)
        # One op per list, not per param: each op returns to Python and needs the GIL back,
        # which the main thread (a launch-bound forward, a checkpointed block's recompute)
        # may hold for a whole switch interval (5 ms) each time.
        if fresh[0]:
            torch._foreach_copy_(*fresh)
            for master, buffer in zip(fresh_masters, fresh[0], strict=True):
                master.grad = buffer
        if added[0]:
            add_start = time.perf_counter()
            torch._foreach_add_(*self._add_lists(added_slots, *added))
            self.add_s += time.perf_counter() - add_start
            self.added_params += sum(slot.numel for slot in added_slots)
        self.busy_s += time.perf_counter() - start

    def _add_lists(
        self, slots: list[ParamSlot], grads: list[torch.Tensor], staged: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The operands of one ``_foreach_add_(grads, staged)`` (of ``slots``' params): a pair
        of mixed dtypes as ACCUMULATE_BLOCK views (made once per gradient buffer), the others
        as they are."""
        left: list[torch.Tensor] = []
        right: list[torch.Tensor] = []
        for slot, grad, stage in zip(slots, grads, staged, strict=True):
            if grad.dtype == stage.dtype or slot.numel <= ACCUMULATE_BLOCK:
                left.append(grad)
                right.append(stage)
                continue
            key = id(slot.param)
            cached = self.add_views.get(key)
            if cached is None or cached[0] is not grad:
                flat_grad, flat_stage = grad.view(-1), stage.view(-1)
                cached = (
                    grad,
                    list(flat_grad.split(ACCUMULATE_BLOCK)),
                    list(flat_stage.split(ACCUMULATE_BLOCK)),
                )
                self.add_views[key] = cached
            left.extend(cached[1])
            right.extend(cached[2])
        return left, right

    def _staged(self, slot: ParamSlot, chunk: Chunk) -> torch.Tensor:
        """``slot``'s pinned gradient staging (a view made once: each view is ops too)."""
        view = self.staged_views.get(id(slot.param))
        if view is None:
            view = self.manager.staging_view(slot, chunk)
            self.staged_views[id(slot.param)] = view
        return view

    def _before_staging_write(self, index: int) -> None:
        """Chunk ``index``'s staging is about to be overwritten (a second backward before
        ``zero_grad``): copy the gradients aliased to it out first, on the worker in order."""
        if index not in self.aliased:
            return
        self.aliased.discard(index)
        chunk = self.manager.chunks[index]
        future = self.worker.submit(self._unalias, chunk)
        self.manager.staging_busy[index] = future
        self.grads_busy[index] = future

    def _unalias(self, chunk: Chunk) -> None:
        """Copy ``chunk``'s aliased gradients out of their staging. Only gradient accumulation
        does this: its time and elements count with the adds (``add_s``, ``added_params``),
        as the cost model charges it at the add rate (``cost_time.later_on_cpu``). Counted as
        update time, it reads 3.6B's update at 3.8 Gparam/s against its kernel's 5.3, and the
        step 17.5% off its prediction."""
        start = time.perf_counter()
        masters, buffers, staged = [], [], []
        for slot in chunk.trainable_slots:
            master = self.masters.get(id(slot.param))
            view = self._staged(slot, chunk)
            if master is None or master.grad is None or master.grad.data_ptr() != view.data_ptr():
                continue
            masters.append(master)
            buffers.append(self._grad_buffer(slot, master))
            staged.append(view)
        if buffers:
            torch._foreach_copy_(buffers, staged)
            for master, buffer in zip(masters, buffers, strict=True):
                master.grad = buffer
        elapsed = time.perf_counter() - start
        self.busy_s += elapsed
        copied = sum(buffer.numel() for buffer in buffers)
        self.add_s += elapsed
        self.added_params += copied
        self.copied_params += copied

    def _grad_buffer(self, slot: ParamSlot, master: torch.Tensor) -> torch.Tensor:
        """The param's own host gradient buffer (made on first use), for copies of staging."""
        buffer = self.grad_buffers.get(id(slot.param))
        if buffer is None:
            buffer = torch.empty_like(master)
            self.grad_buffers[id(slot.param)] = buffer
        return buffer

    def _hold_staging(self, index: int, future: Future) -> None:
        """An aliased chunk's staging is read by ``future`` (its update, or the zero_grad clear):
        the next write into it waits for that."""
        if index in self.aliased:
            self.manager.staging_busy[index] = future

    def mark(self) -> tuple[float, int, float, int]:
        """``(busy_s, updated_params, add_s, added_params)`` now: the start of a window
        ``calibration.worker_rate`` and ``accumulate_rate`` measure over (take it while the
        worker is idle). The adds' seconds and elements include the copies out of an aliased
        staging (``copied_params`` of them), which gradient accumulation costs alike."""
        return self.busy_s, self.updated_params, self.add_s, self.added_params

    def wait(self) -> None:
        """Block until every queued accumulation and update is done."""
        self.worker.submit(lambda: None).result()
        self.gpu.wait()

    def zero_grad(self, set_to_none: bool = True, param_ids: set[int] | None = None) -> None:
        """Forget the accumulated host gradients (the user's ``zero_grad``); returns at once.

        ``param_ids``: only those params' (an optimizer's ``zero_grad`` clears its own params,
        as torch's does); None: every offloaded param's (``model.zero_grad()``).

        The clearing is queued on the worker behind the updates still running, so the next
        forward overlaps them: waiting here (as ``step(); zero_grad()`` loops call it right
        after the step) put the whole CPU update on the critical path (3.2B: a 308 ms idle GPU
        per step). Everything that reads host gradients waits for the worker first."""

        self.check_no_early_update("zero_grad() without optimizer.step()")
        if param_ids is not None and not self.covers_all(param_ids):
            self._zero_some(set_to_none, param_ids)
            return

        def clear() -> None:
            for master in self.masters.values():
                if set_to_none:
                    master.grad = None
                elif master.grad is not None:
                    master.grad.zero_()

        future = self.worker.submit(clear)
        # The clear drops (or zeroes) gradients aliased to staging: the next writes wait for it.
        for index in self.aliased:
            self.manager.staging_busy[index] = future
        self.aliased.clear()
        self.accumulations.clear()
        self.device_norms.clear()
        self.norm_of_sum.clear()
        self.clip_coef = 1.0

    def _zero_some(self, set_to_none: bool, param_ids: set[int]) -> None:
        """``zero_grad`` of part of the offloaded params: the others keep accumulating."""
        self.host_grads()  # a pending clipping coefficient applies to the kept ones too
        for chunk in self.manager.chunks:
            # The kept gradients must not be the staging the next backward writes into.
            if chunk.index in self.aliased:
                self._before_staging_write(chunk.index)
        cleared = [m for pid, m in self.masters.items() if pid in param_ids]

        def clear() -> None:
            for master in cleared:
                if set_to_none:
                    master.grad = None
                elif master.grad is not None:
                    master.grad.zero_()

        self.worker.submit(clear)
        for pid in param_ids:
            self.accumulations.pop(pid, None)
            self.device_norms.pop(pid, None)
            self.norm_of_sum.discard(pid)

    # ---- optimizer ----------------------------------------------------------------------------

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        """Mirror ``optimizer`` for the offloaded params it owns (several optimizers may each
        own a part of the model)."""
        owned = {
            id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]
        }
        if not any(pid in owned for pid in self.offloaded_ids):
            return
        check_optimizer_class(optimizer)
        if not any(o is optimizer for o in self.optimizers):
            self.optimizers.append(optimizer)
        for pid, group in owned.items():
            self.optimizer_of_param[pid] = optimizer
            self.group_of_param[pid] = group
        for key in [k for k in self.twins if k[1] == id(optimizer)]:
            del self.twins[key]
        self._gpu_problems.pop(id(optimizer), None)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The first bound optimizer (most scripts have exactly one)."""
        return self.optimizers[0] if self.optimizers else None

    def _twin(self, chunk: Chunk, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
        """The CPU twin of ``optimizer`` over ``chunk``'s masters it owns (built on first use)."""
        key = (chunk.index, id(optimizer))
        twin = self.twins.get(key)
        if twin is not None:
            return twin
        by_group: dict[int, list[torch.Tensor]] = {}
        # Every param with a master, frozen ones too: one frozen now and unfrozen later must
        # still be updated (torch optimizers skip params without a gradient).
        for slot in chunk.slots:
            pid = id(slot.param)
            if self.optimizer_of_param.get(pid) is optimizer and pid in self.masters:
                by_group.setdefault(self.group_of_param[pid], []).append(self.masters[pid])
        if not by_group:
            return None
        cls = type(optimizer)
        groups = [
            {"params": params, **_twin_group(optimizer.param_groups[g], cls)}
            for g, params in by_group.items()
        ]
        kwargs = {}
        if "fused" in inspect.signature(cls.__init__).parameters and cls.__name__ in FUSED_ON_CPU:
            kwargs["fused"] = True
        twin = cls(groups, **kwargs)
        self.twins[key] = twin
        self.twin_group_index[key] = list(by_group)
        return twin

    def twins_of(self, chunk: Chunk) -> list[torch.optim.Optimizer]:
        """Every CPU twin built over ``chunk`` (one per optimizer owning part of it)."""
        return [twin for (index, _), twin in self.twins.items() if index == chunk.index]

    def step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Queue the update of ``optimizer``'s offloaded params (default: the first bound
        optimizer), chunk by chunk in forward order; returns at once."""
        optimizer = optimizer if optimizer is not None else self.optimizer
        if optimizer is None or not any(o is optimizer for o in self.optimizers):
            return
        owned = {pid for pid, o in self.optimizer_of_param.items() if o is optimizer}
        if self.clip_coef != 1.0 and not self.covers_all(owned):
            self.host_grads()  # the pending coefficient covers other optimizers' grads too
        queued = False
        on_gpu: list[tuple[Chunk, torch.optim.Optimizer, list[dict], Future | None]] = []
        gpu_ok = bool(self.gpu_chunks) and self.gpu_path_problem(optimizer) is None
        for chunk in self.manager.chunks:
            if chunk.index in self.manager.persistent or not chunk.trainable_slots:
                continue
            twin = self._twin(chunk, optimizer)
            if twin is None:
                continue
            hyper = self._hyper(chunk, optimizer)
            if gpu_ok and chunk.index in self.gpu_chunks and chunk.index not in self.early:
                self.manager.before_host_write(chunk.index)
                on_gpu.append((chunk, twin, hyper, self.grads_busy.get(chunk.index)))
                continue
            # Only a chunk's one owner updates it early, and it has the chunk's only twin.
            early = self.early.pop(chunk.index, None)
            if early is not None:
                if early[1] != hyper:
                    raise UpdateInBackwardError(
                        f"optimizer.step() runs chunk {chunk.index} with hyperparameters"
                        f" {hyper} but the update in the backward"
                        f" ({self.update_in_backward_origin}) updated it during backward with"
                        f" {early[1]}; change them before backward (schedulers stepping after"
                        " optimizer.step() do) or set AUTOOFFLOAD_UPDATE_IN_BACKWARD=0"
                    )
                continue  # updated in the backward
            self._queue_update(chunk, twin, hyper, self.clip_coef)
            queued = True
        if on_gpu:
            futures = self.gpu.queue(on_gpu, self.clip_coef)
            for (chunk, *_), future in zip(on_gpu, futures, strict=True):
                self.manager.host_busy[chunk.index] = future
                self._hold_staging(chunk.index, future)
            # The worker's next tasks (zero_grad's clear, the next backward's gradients, the
            # next updates) touch the gradients and staging these read: they wait for them.
            flush = self.gpu.last_flush
            assert flush is not None
            self.worker.submit(flush.result)
        if queued and self.manager.is_cuda:
            openmp.warn_if_spinning()  # once per process
        self.clip_coef = 1.0

    def gpu_path_problem(
        self, optimizer: torch.optim.Optimizer, in_backward: bool = False
    ) -> str | None:
        """Why ``optimizer``'s offloaded chunks cannot take a GPU update path (at ``step()``, or
        ``in_backward``); None if they can (the path runs torch's fused Adam kernels on the
        params' own bytes). Under data parallelism the update in the backward needs sharded
        state (each chunk's owner updates it as its averaged gradients arrive), the update at
        ``step()`` replicated state."""
        name = type(optimizer).__name__
        if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
            return f"the optimizer is {name}, not one of torch.optim.{{Adam, AdamW}}"
        if any(g.get("differentiable") for g in optimizer.param_groups):
            return "the optimizer is differentiable"
        if self.sharding is not None and not in_backward:
            return "the optimizer state is sharded across ranks"
        if in_backward and self.manager.data_parallel is not None and self.sharding is None:
            # Each rank would update its replica alone: one taking the CPU for a chunk (a
            # gradient it lacks) would round otherwise than the others.
            return "the optimizer state is replicated across ranks (AUTOOFFLOAD_SHARD_OPTIMIZER)"
        offloaded = (c for c in self.manager.chunks if c.index not in self.manager.persistent)
        # ``_copy_back`` (made once per chunk) names a host view only where the master is not
        # the host store's bytes: an fp32 master.
        if any(host is not None for c in offloaded for host, _ in self._copy_back(c)):
            return "fp32 master weights are on (AUTOOFFLOAD_MASTER_WEIGHTS)"
        return None

    def _queue_update(
        self, chunk: Chunk, twin: torch.optim.Optimizer, hyper: list[dict], clip_coef: float
    ) -> None:
        """Queue ``chunk``'s update on the worker: it writes the chunk's host bytes (live
        state-dict aliases of them are copied out first) and reads its staging."""
        self.manager.before_host_write(chunk.index)
        future = self.worker.submit(self._update, chunk, twin, hyper, clip_coef)
        self.manager.host_busy[chunk.index] = future
        self.grads_busy[chunk.index] = future
        self._hold_staging(chunk.index, future)

    def _update(
        self, chunk: Chunk, twin: torch.optim.Optimizer, hyper: list[dict], clip_coef: float
    ) -> None:
        start = time.perf_counter()
        # Scaling the gradients here, as clip_grad_norm_ would have, keeps the update identical
        # to plain training; passing 1/coef as the fused kernels' grad_scale would save this
        # pass but rounds differently (measured: weights drift ~1e-5 from plain in 20 steps).
        if clip_coef != 1.0:
            grads = [p.grad for g in twin.param_groups for p in g["params"] if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, clip_coef)
        for group, values in zip(twin.param_groups, hyper, strict=True):
            group.update(values)
        kernel_start = time.perf_counter()
        twin.step()
        self.kernel_s += time.perf_counter() - kernel_start
        # Only params with a gradient were stepped (a frozen one has none).
        updated = {
            id(p) for group in twin.param_groups for p in group["params"] if p.grad is not None
        }
        n_updated = 0
        hosts, masters = [], []
        for host, master in self._copy_back(chunk):
            if id(master) in updated:
                n_updated += master.numel()
                if host is not None:
                    hosts.append(host)
                    masters.append(master)
        if hosts:
            torch._foreach_copy_(hosts, masters)  # one op: see _accumulate
        elapsed = time.perf_counter() - start
        self.busy_s += elapsed
        self.update_s += elapsed
        self.updated_params += n_updated
        self.updates += 1

    def _copy_back(self, chunk: Chunk) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
        """(host view or None, master) of every ``chunk`` param with a master, made once; the
        host view is None where the master is the host store's bytes (nothing to write)."""
        pairs = self.copy_back.get(chunk.index)
        if pairs is None:
            pairs = []
            for slot in chunk.slots:
                master = self.masters.get(id(slot.param))
                if master is None:
                    continue
                host = self.manager.host_view(slot, chunk)
                pairs.append((host if master.data_ptr() != host.data_ptr() else None, master))
            self.copy_back[chunk.index] = pairs
        return pairs

    def release_chunk(self, chunk: Chunk) -> dict[int, dict]:
        """Stop managing ``chunk`` (it became persistent): drop its masters, host grads and
        twins; return the twins' state per param id, for the user's optimizer to take over."""
        self.wait()
        states: dict[int, dict] = {}
        for key in [k for k in self.twins if k[0] == chunk.index]:
            twin = self.twins.pop(key)
            self.twin_group_index.pop(key, None)
            for slot in chunk.slots:
                master = self.masters.get(id(slot.param))
                if master is not None and master in twin.state:
                    states[id(slot.param)] = dict(twin.state[master])
        self.aliased.discard(chunk.index)
        self.copy_back.pop(chunk.index, None)
        self.grads_busy.pop(chunk.index, None)
        for slot in chunk.slots:
            self.staged_views.pop(id(slot.param), None)
            self.add_views.pop(id(slot.param), None)
            self.offloaded_ids.discard(id(slot.param))
            self.masters.pop(id(slot.param), None)
            self.grad_buffers.pop(id(slot.param), None)
            self.accumulations.pop(id(slot.param), None)
            self.device_norms.pop(id(slot.param), None)
            self.norm_of_sum.discard(id(slot.param))
        return states

    def promote_chunk(self, chunk: Chunk, device: torch.device) -> None:
        """``chunk`` becomes persistent: its CPU optimizer state moves to the user's optimizer
        (in the param's dtype, on ``device``; ``step`` where that optimizer keeps it) and its
        masters are dropped."""
        states = self.release_chunk(chunk)
        if self.sharding is not None and chunk.index in self.sharding.trainable:
            # Only the owner had the state; every rank's optimizer takes it over.
            by_name = {s.name: states.get(id(s.param)) for s in chunk.trainable_slots}
            by_name = self.sharding.broadcast_states(by_name, chunk.index)
            states = {id(s.param): by_name[s.name] for s in chunk.trainable_slots}
        for slot in chunk.trainable_slots:
            state = states.get(id(slot.param))
            optimizer = self.optimizer_of_param.get(id(slot.param))
            if not state or optimizer is None:
                continue
            group = optimizer.param_groups[self.group_of_param[id(slot.param)]]
            on_device = bool(group.get("fused") or group.get("capturable"))
            moved = {}
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    moved[key] = value
                elif value.numel() != slot.numel or value.dim() == 0:
                    # Scalar state (``step``, NAdam's ``mu_product``): where the optimizer keeps
                    # its step, in its own dtype.
                    moved[key] = value.to(device if on_device else "cpu")
                else:
                    moved[key] = value.to(device, slot.dtype).view(slot.shape)
            optimizer.state[slot.param] = moved

    def demote_chunk(self, chunk: Chunk) -> None:
        """``chunk`` is offloaded again (a re-plan; the manager wrote its bytes back to the host
        store): its trainable params get masters from those bytes (on the owner, under sharded
        state) and are updated by the CPU twins from now on. Their state is still in the
        user's optimizer; ``state.adopt_existing_state`` moves it to the twins."""
        self.wait()
        for slot in chunk.trainable_slots:
            # The gradient left from the step just taken (no zero_grad yet): an offloaded
            # param has none on the device, and zero_grad(set_to_none=False) would keep this
            # one there for good, memory the new plan does not count.
            slot.param.grad = None
            self.offloaded_ids.add(id(slot.param))
        if self.sharding is None or self.sharding.owns(chunk.index):
            self._make_masters(chunk)

    def shutdown(self) -> None:
        """Join the worker and drop every host tensor this side holds (masters that are views
        of the pinned host store, host gradients, twin states) and the manager's callbacks into
        it: after detach the pinned memory is freed at once, not at the next cyclic gc."""
        self.worker.shutdown(wait=True)
        self.gpu.shutdown()
        self.manager.on_grads_ready = None
        self.manager.on_grads_averaging = None
        self.manager.before_staging_write = None
        self.manager.device_sums = None
        tables = (self.masters, self.grad_buffers, self.twins, self.twin_group_index)
        for table in (*tables, self.staged_views, self.add_views, self.copy_back):
            table.clear()
        self.grads_busy.clear()
        self.early.clear()
        self.persistent_early.clear()
        self.aliased.clear()
        self.device_norms.clear()
        self.norm_of_sum.clear()
        self.accumulations.clear()
        self.optimizers.clear()
        self.optimizer_of_param.clear()
