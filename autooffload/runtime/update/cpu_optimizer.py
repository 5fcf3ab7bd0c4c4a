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
Its parts, each an object it owns: the twins (``twins.py``), the host gradients from the staging
(``staging``, ``grad_staging.py``), their norms and clipping (``grad_norms``, ``host_grads.py``),
the update in the backward (``early`` and ``in_backward``, ``in_backward.py``) and the GPU update
path (``gpu``, ``gpu_update.py``).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from autooffload import openmp
from autooffload.runtime.chunks.layout import Chunk, ParamSlot
from autooffload.runtime.chunks.store import ChunkManager
from autooffload.runtime.update.gpu_update import GpuUpdater
from autooffload.runtime.update.grad_staging import GradStaging
from autooffload.runtime.update.host_grads import HostGradNorms
from autooffload.runtime.update.in_backward import (
    ACCUMULATED,
    SHARED,
    BackwardUpdates,
    EarlyUpdates,
)
from autooffload.runtime.update.twins import Twins, check_optimizer_class


def update_threads(setting: int | None, on_gpu: bool) -> int:
    """Threads of the CPU updates: the setting, else torch's intra-op threads, less one on a
    GPU run. The main thread launches every kernel of the forward the update overlaps; with as
    many busy OpenMP threads as cores, it and one OpenMP straggler take turns on a core, and
    both the GPU (idle between launches) and the update (waiting at each barrier) slow down."""
    if setting is not None:
        return setting
    available = torch.get_num_threads()
    return max(1, available - 1) if on_gpu and available > 2 else available


class CpuOptimizer:
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
        # Per param id: the fp32 master, or the host store's bytes themselves (a model in
        # fp32, or master weights off). The parts below read it; only this class writes it.
        self.masters: dict[int, torch.Tensor] = {}
        # Every offloaded trainable param, on every rank (masters exist only for the chunks
        # this rank owns when the state is sharded: runtime/parallel/sharding.py).
        self.offloaded_ids: set[int] = set()
        self.sharding = manager.sharding
        self.twins = Twins(self.masters)
        self.early = EarlyUpdates(self.twins)
        self.grad_norms = HostGradNorms(
            self.masters, self.offloaded_ids, self.sharding, wait=self.wait, early=self.early
        )
        self.staging = GradStaging(manager.grads, self.worker, self.masters, self.grad_norms)
        # The GPU update path (runtime/update/gpu_update.py) and the chunks the plan gives it
        # at step().
        self.gpu = GpuUpdater(manager)
        self.gpu_chunks: set[int] = set()
        # Per optimizer id: why its chunks cannot take the GPU path in the backward (None: they
        # can), until it is bound again.
        self._gpu_problems: dict[int, str | None] = {}
        self.in_backward = BackwardUpdates(
            manager,
            self.gpu,
            self.twins,
            self.masters,
            self.early,
            self.grad_norms,
            gpu_problem=self._gpu_problem_in_backward,
            holds_gradients=self.staging.holds_gradients,
        )
        # Per chunk: (host view or None, master) of each param with a master (``_copy_back``).
        self._copy_backs: dict[int, list[tuple[torch.Tensor | None, torch.Tensor]]] = {}
        self.update_s = 0.0
        # Seconds inside the twins' step() alone: against update_s, what the kernels take and
        # what the rest (gradient copies, Python, waits for the GIL between ops) adds.
        self.kernel_s = 0.0
        self.updated_params = 0
        self.updates = 0
        # Of them, those queued in a backward (``_update_now``).
        self.updates_in_backward = 0
        manager.grads.connect_update(
            self._grads_ready,
            self.in_backward.update_averaged_on_device,
            self.staging.before_staging_write,
            self.staging.device_sums,
        )
        for chunk in manager.chunks:
            if chunk.index in manager.persistent:
                continue
            self.offloaded_ids.update(id(s.param) for s in chunk.trained_slots)
            if self.sharding is None or self.sharding.owns(chunk.index):
                self._make_masters(chunk)

    def _make_masters(self, chunk: Chunk) -> None:
        for slot in chunk.trained_slots:
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
        """Every slot of a non-persistent chunk trainable at attach (frozen since or not)."""
        return [
            (chunk, slot)
            for chunk in self.manager.chunks
            if chunk.index not in self.manager.persistent
            for slot in chunk.trained_slots
        ]

    @property
    def busy_s(self) -> float:
        """Seconds the worker was busy: updates, and gradients into the host gradients."""
        return self.update_s + self.staging.busy_s

    def mark(self) -> tuple[float, int, float, int]:
        """``(busy_s, updated_params, add_s, added_params)`` now: the start of a window
        ``calibration.worker_rate`` and ``accumulate_rate`` measure over (take it while the
        worker is idle). The adds' seconds and elements include the copies out of an aliased
        staging (``copied_params`` of them), which gradient accumulation costs alike."""
        staging = self.staging
        return self.busy_s, self.updated_params, staging.add_s, staging.added_params

    def wait(self) -> None:
        """Block until every queued accumulation and update is done."""
        self.worker.submit(lambda: None).result()
        self.gpu.wait()

    # ---- optimizer ----------------------------------------------------------------------------

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        """Mirror ``optimizer`` for the offloaded params it owns (several optimizers may each
        own a part of the model)."""
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if not any(pid in owned for pid in self.offloaded_ids):
            return
        check_optimizer_class(optimizer)
        self.twins.bind(optimizer)
        self._gpu_problems.pop(id(optimizer), None)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The bound optimizers."""
        return self.twins.optimizers

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The first bound optimizer (most scripts have exactly one)."""
        return self.twins.optimizer

    def place(self, at_step: set[int], in_backward: set[int], accumulate_on_gpu: bool) -> None:
        """The plan's placement of the work on offloaded chunks: the chunks the GPU updates at
        ``step()`` and in the backward, and whether gradient accumulation sums on the GPU."""
        self.gpu_chunks = at_step
        self.in_backward.set_gpu_chunks(in_backward)
        self.staging.set_accumulate_on_gpu(accumulate_on_gpu)

    # ---- gradients in -------------------------------------------------------------------------

    def _grads_ready(
        self,
        chunk: Chunk,
        slots: list[ParamSlot],
        event: torch.cuda.Event | None,
        norms: tuple[torch.Tensor, ...] = (),
        presence: torch.Tensor | None = None,
        summed: bool = False,
    ) -> None:
        """``chunk``'s gradients left the device (``GradientOffload.connect_update``): into the
        host gradients (``GradStaging.receive``), and under the update in the backward the
        chunk's update right behind them."""
        self.early.note_gradients(chunk)
        earlier = self.staging.holds_gradients(chunk)
        self.staging.receive(chunk, slots, event, norms, presence, summed)
        if earlier:
            # Only step() has the whole sum; the auto mode takes it as a reason, observing too.
            self.early.add_reason(ACCUMULATED)
        elif self.in_backward.armed:
            self._update_now(chunk)

    def _update_now(self, chunk: Chunk) -> None:
        """Queue ``chunk``'s update right behind its gradients (ProTrain's overlap of the CPU
        update with the backward): exact when ``step()`` follows this backward with the same
        hyperparameters and nothing between them reads or scales the gradients, which
        ``step``, ``clip_``, ``host_grads`` and ``zero_grad`` check (``EarlyUpdates``)."""
        optimizer = self.twins.sole_owner(chunk)
        if optimizer is None:
            # No optimizer bound yet, or several hold its params: left to step(). Each of
            # several steps them with its own state, whichever steps: the auto mode turns off.
            if self.twins.shared(chunk):
                self.early.add_reason(SHARED)
            return
        twin = self.twins.twin(chunk, optimizer)
        if twin is None or self.grad_norms.clip_coef != 1.0:
            return
        hyper = self.twins.hyper(chunk, optimizer)
        self.early.record(chunk.index, optimizer, hyper)
        self._queue_update(chunk, twin, hyper, 1.0)
        self.updates_in_backward += 1

    def zero_grad(self, set_to_none: bool = True, param_ids: set[int] | None = None) -> None:
        """Forget the accumulated host gradients of ``param_ids`` (None: every offloaded
        param's), as the user's ``zero_grad`` does; returns at once (``GradStaging.zero_grad``)."""
        self.early.check_no_early_update("zero_grad() without optimizer.step()")
        self.staging.zero_grad(set_to_none, param_ids)

    # ---- optimizer ----------------------------------------------------------------------------

    def step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Queue the update of ``optimizer``'s offloaded params (default: the first bound
        optimizer), chunk by chunk in forward order; returns at once."""
        self.twins.prune()  # an optimizer the script dropped: its twins' state is freed
        optimizer = optimizer if optimizer is not None else self.optimizer
        if optimizer is None or not any(o is optimizer for o in self.optimizers):
            return
        owned = self.twins.params_of(optimizer)
        norms = self.grad_norms
        if norms.clip_coef != 1.0 and not norms.covers_all(owned):
            norms.host_grads()  # the pending coefficient covers other optimizers' grads too
        clip_coef = norms.clip_coef
        queued = False
        on_gpu: list[tuple[Chunk, torch.optim.Optimizer, list[dict], Future | None]] = []
        gpu_ok = bool(self.gpu_chunks) and self.gpu_path_problem(optimizer) is None
        for chunk in self.manager.chunks:
            # A param frozen since its backward still has its host gradient, which torch's
            # optimizers step like any other.
            if chunk.index in self.manager.persistent or not chunk.trained_slots:
                continue
            twin = self.twins.twin(chunk, optimizer)
            if twin is None:
                continue
            hyper = self.twins.hyper(chunk, optimizer)
            early = chunk.index in self.early.offloaded
            # The GPU path writes the whole chunk's host bytes back: a chunk holding another
            # optimizer's params too takes the worker's path, in order with that one's update
            # (on the GPU path it could write back their bytes from before it).
            sole = self.twins.sole_owner(chunk) is optimizer
            if gpu_ok and chunk.index in self.gpu_chunks and not early and sole:
                self.manager.before_host_write(chunk.index)
                on_gpu.append((chunk, twin, hyper, self.staging.grads_busy.get(chunk.index)))
                continue
            # Only a chunk's one owner updates it early.
            if self.early.settle(chunk.index, optimizer, hyper):
                continue  # updated in the backward
            self._queue_update(chunk, twin, hyper, clip_coef)
            queued = True
        if on_gpu:
            futures = self.gpu.queue(on_gpu, clip_coef)
            for (chunk, *_), future in zip(on_gpu, futures, strict=True):
                self.manager.host_busy.set(chunk.index, future)
                self.staging.hold_staging(chunk.index, future)
            # The worker's next tasks (zero_grad's clear, the next backward's gradients, the
            # next updates) touch the gradients and staging these read: they wait for them.
            flush = self.gpu.last_flush
            assert flush is not None
            self.worker.submit(flush.result)
        if queued and self.manager.is_cuda:
            openmp.warn_if_spinning()  # once per process
        norms.reset_clip()

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

    def _gpu_problem_in_backward(self, optimizer: torch.optim.Optimizer) -> str | None:
        """``gpu_path_problem`` in the backward, found once per binding of ``optimizer``."""
        key = id(optimizer)
        if key not in self._gpu_problems:
            self._gpu_problems[key] = self.gpu_path_problem(optimizer, in_backward=True)
        return self._gpu_problems[key]

    def _queue_update(
        self, chunk: Chunk, twin: torch.optim.Optimizer, hyper: list[dict], clip_coef: float
    ) -> None:
        """Queue ``chunk``'s update on the worker: it writes the chunk's host bytes (live
        state-dict aliases of them are copied out first) and reads its staging."""
        self.manager.before_host_write(chunk.index)
        future = self.worker.submit(self._update, chunk, twin, hyper, clip_coef)
        self.manager.host_busy.set(chunk.index, future)
        self.staging.read_by(chunk.index, future)

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
        self.update_s += time.perf_counter() - start
        self.updated_params += n_updated
        self.updates += 1

    def _copy_back(self, chunk: Chunk) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
        """(host view or None, master) of every ``chunk`` param with a master, made once; the
        host view is None where the master is the host store's bytes (nothing to write)."""
        pairs = self._copy_backs.get(chunk.index)
        if pairs is None:
            pairs = []
            for slot in chunk.slots:
                master = self.masters.get(id(slot.param))
                if master is None:
                    continue
                host = self.manager.host_view(slot, chunk)
                pairs.append((host if master.data_ptr() != host.data_ptr() else None, master))
            self._copy_backs[chunk.index] = pairs
        return pairs

    def _grads_to_params(self, chunk: Chunk, device: torch.device) -> None:
        """``chunk`` leaves the CPU optimizer (a re-plan makes it persistent, or detach): each
        param's host gradient (pending clipping applied) becomes its ``.grad`` on ``device``,
        where plain torch would have kept it until ``zero_grad``: a ``step()`` after, or a later
        backward adding to it, goes on like plain. Not for a chunk updated in the backward (its
        gradients were used), nor under sharded state (a rank holds only its own chunks'
        gradients)."""
        if self.sharding is not None or chunk.index in self.early.offloaded:
            return
        coef = self.grad_norms.clip_coef
        for slot in chunk.trained_slots:
            master = self.masters.get(id(slot.param))
            if master is None or master.grad is None:
                continue
            grad = master.grad * coef if coef != 1.0 else master.grad
            slot.param.grad = grad.to(device=device, dtype=slot.dtype, copy=True).view(slot.shape)

    def release_chunk(
        self, chunk: Chunk
    ) -> dict[int, tuple[torch.optim.Optimizer, dict[int, dict]]]:
        """Stop managing ``chunk`` (it became persistent): drop its masters, host grads and
        twins; return each optimizer's twin state per param id (``Twins.release``), for the
        user's optimizers to take over."""
        self.wait()
        states = self.twins.release(chunk)
        self.staging.forget_chunk(chunk)
        self._copy_backs.pop(chunk.index, None)
        for slot in chunk.slots:
            self.offloaded_ids.discard(id(slot.param))
            self.masters.pop(id(slot.param), None)
        return states

    def promote_chunk(self, chunk: Chunk, device: torch.device) -> None:
        """``chunk`` becomes persistent: the CPU optimizer state moves to the user's optimizers
        (each its own twin's, in the param's dtype, on ``device``; ``step`` where that optimizer
        keeps it) and its masters are dropped; its host gradients become the params' ``.grad``."""
        self.wait()
        self._grads_to_params(chunk, device)
        released = self.release_chunk(chunk)
        if self.sharding is not None and chunk.index in self.sharding.trainable:
            # Only the owner had the state; every rank's optimizers take it over. One
            # collective per chunk, its entries named by the optimizers' binding order (which
            # of them still exist may differ between ranks until their garbage is collected).
            twins = self.twins
            by_name = {
                f"{twins.serial_of(optimizer)}/{s.name}": states.get(id(s.param))
                for optimizer, states in released.values()
                for s in chunk.trained_slots
            }
            by_name = self.sharding.broadcast_states(by_name, chunk.index)
            released = {}
            for key, state in by_name.items():
                serial, name = key.split("/", 1)
                optimizer = twins.of_serial(int(serial))
                slot = next((s for s in chunk.trained_slots if s.name == name), None)
                if optimizer is not None and slot is not None:
                    released.setdefault(id(optimizer), (optimizer, {}))[1][id(slot.param)] = state
        # Frozen ones too: torch keeps their state for when they are trained again.
        for optimizer, states in released.values():
            for slot in chunk.trained_slots:
                state = states.get(id(slot.param))
                if not state:
                    continue
                group = optimizer.param_groups[self.twins.group_of(optimizer, id(slot.param))]
                on_device = bool(group.get("fused") or group.get("capturable"))
                moved = {}
                for key, value in state.items():
                    if not isinstance(value, torch.Tensor):
                        moved[key] = value
                    elif value.numel() != slot.numel or value.dim() == 0:
                        # Scalar state (``step``, NAdam's ``mu_product``): where the optimizer
                        # keeps its step, in its own dtype.
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
        for slot in chunk.trained_slots:
            self.offloaded_ids.add(id(slot.param))
        owner = self.sharding is None or self.sharding.owns(chunk.index)
        if owner:
            self._make_masters(chunk)
        for slot in chunk.trained_slots:
            # A gradient not cleared yet (the step just taken, or one still accumulating for
            # a later step) becomes the host gradient: an offloaded param has none on the
            # device, where zero_grad(set_to_none=False) would keep it for good.
            if slot.param.grad is not None and owner:
                self.staging.adopt(slot, self.masters[id(slot.param)], slot.param.grad)
            slot.param.grad = None

    def shutdown(self) -> None:
        """Join the worker and drop every host tensor this side holds (masters that are views
        of the pinned host store, host gradients, twin states), the manager's callbacks into
        it and its parts' (cycles through it): after detach the pinned memory is freed at
        once, not at the next cyclic gc."""
        self.worker.shutdown(wait=True)
        self.gpu.shutdown()
        self.manager.grads.connect_update(None, None, None, None)
        self.masters.clear()
        self._copy_backs.clear()
        self.twins.clear()
        self.staging.clear()
        self.grad_norms.close()
        self.in_backward.close()
        self.early.clear()
