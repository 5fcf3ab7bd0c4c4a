"""CPU side of the split optimizer: fp32 masters, the CPU twins and the worker thread.

The user's optimizer stays the user's object and updates the persistent (GPU) parameters
itself: offloaded parameters carry no ``.grad`` on the GPU at step time, so torch optimizers
skip them. For every offloaded trainable parameter this module keeps an fp32 master (or uses
the host copy itself when the model is fp32, or when master weights are off), accumulates its
gradients as they arrive from the GPU, and at ``optimizer.step()`` updates it with a CPU twin
of the user's optimizer class, whose hyperparameters are copied from the user's
``param_groups`` at every step so LR schedulers keep working. The work runs on one worker
thread, in order: a chunk's update is queued after its gradient accumulation, and the next
forward's copy of that chunk to the GPU waits for the update (``ChunkManager.host_busy``).
Its parts: the gradient staging and accumulation (``grad_staging.py``), the update in the
backward (``in_backward.py``), the host gradients' norms and clipping (``host_grads.py``) and the
GPU update path (``gpu_update.py``).
"""

from __future__ import annotations

import inspect
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from autooffload import openmp
from autooffload.errors import UpdateInBackwardError
from autooffload.runtime.chunks.layout import Chunk, ParamSlot
from autooffload.runtime.chunks.store import ChunkManager
from autooffload.runtime.update.gpu_update import GpuUpdater
from autooffload.runtime.update.grad_staging import GradStaging
from autooffload.runtime.update.host_grads import HostGradNorms
from autooffload.runtime.update.in_backward import BackwardUpdates
from autooffload.runtime.update.twins import FUSED_ON_CPU, check_optimizer_class, twin_group


def update_threads(setting: int | None, on_gpu: bool) -> int:
    """Threads of the CPU updates: the setting, else torch's intra-op threads, less one on a
    GPU run. The main thread launches every kernel of the forward the update overlaps; with as
    many busy OpenMP threads as cores, it and one OpenMP straggler take turns on a core, and
    both the GPU (idle between launches) and the update (waiting at each barrier) slow down."""
    if setting is not None:
        return setting
    available = torch.get_num_threads()
    return max(1, available - 1) if on_gpu and available > 2 else available


class CpuOptimizer(GradStaging, BackwardUpdates, HostGradNorms):
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
        manager.grads.connect_update(
            self._grads_ready,
            self.update_averaged_on_device,
            self._before_staging_write,
            self.device_sums,
        )
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
            {"params": params, **twin_group(optimizer.param_groups[g], cls)}
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
                self.manager.host_busy.set(chunk.index, future)
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
        if in_backward and self.manager.grads.data_parallel is not None and self.sharding is None:
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
        self.manager.host_busy.set(chunk.index, future)
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
        self.manager.grads.connect_update(None, None, None, None)
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
