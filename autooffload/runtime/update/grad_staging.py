"""Gradient staging and accumulation: offloaded params' gradients from their pinned staging into
host gradients on the worker, aliased to the staging where they can be, and cleared at zero_grad.

The first backward after ``zero_grad`` leaves a chunk's gradients in its staging, and where the
masters have the gradients' dtype the host gradients are the staging itself (``aliased``): no
copy. A later backward (gradient accumulation) would overwrite that staging: the aliased
gradients are copied out first (``before_staging_write``, queued on the worker, at the next
forward already: ``release_staging``), and the new gradients are added on the worker. Under
accumulation on the GPU the staging keeps the running sum, which the device adds to.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from autooffload.runtime.chunks.layout import Chunk, ParamSlot

if TYPE_CHECKING:
    from autooffload.runtime.chunks.grad_offload import GradientOffload
    from autooffload.runtime.update.host_grads import HostGradNorms

# Gradient accumulation adds a micro-batch's staged gradients (the model's dtype) onto fp32
# host gradients. torch adds mixed dtypes by casting the whole staged tensor into a new fp32
# temporary first: for a 64M-element tensor that is a fresh allocation, page faults included,
# per add (16 cores: 2.1 Gparam/s, against 10 for fp32 + fp32). Views of ACCUMULATE_BLOCK
# elements keep each temporary small and reused by the allocator (devtools/host_accumulate_rate.py).
ACCUMULATE_BLOCK = 1 << 20


class GradStaging:
    """Host gradients of a model's offloaded params, from the staging: aliased to it where they
    can be, accumulated on the worker, cleared at ``zero_grad``."""

    def __init__(
        self,
        offload: GradientOffload,
        worker: ThreadPoolExecutor,
        masters: dict[int, torch.Tensor],
        grad_norms: HostGradNorms,
    ) -> None:
        """``offload``: the store's gradient side, whose staging this reads; ``worker``: the CPU
        optimizer's thread, which runs every task on host gradients in order; ``masters``: the
        CPU optimizer's (read here; each one's ``.grad`` is its host gradient)."""
        self._offload = offload
        self._worker = worker
        self._masters = masters
        self._grad_norms = grad_norms
        self.grad_buffers: dict[int, torch.Tensor] = {}
        # Per param id, the pinned gradient staging as a view made once.
        self._staged_views: dict[int, torch.Tensor] = {}
        # Per param id: (host gradient, staging) split in ACCUMULATE_BLOCK views for the adds
        # of mixed dtypes, made once per host gradient buffer.
        self.add_views: dict[int, tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]]
        self.add_views = {}
        # Chunks whose host gradients are their pinned staging itself (main thread's view): the
        # first backward after zero_grad needs no copy out of staging when the dtypes agree
        # (no fp32 masters). The staging is then released before it is written again
        # (``before_staging_write``), at the update (``hold_staging``) or at zero_grad.
        self.aliased: set[int] = set()
        # Chunks whose host gradients are still their staging, zeroed by a
        # ``zero_grad(set_to_none=False)`` (which forgets ``aliased``): the worker's later
        # reads and clears of them are reads and writes of the staging, which the next write
        # into it waits for (``hold_staging``, ``zero_grad``). The next backward aliases them
        # again without a copy (its gradients replace the zeros).
        self.zeroed_in_staging: set[int] = set()
        # Per param: backward passes accumulated since zero_grad.
        self.accumulations: dict[int, int] = {}
        # Gradient accumulation on the GPU (the plan's ``accumulate_on_gpu``): a chunk whose
        # host gradients are its staging (``aliased``) gets the next backward's gradients added
        # to them on the device (``GradientOffload._sum_on_device``), so the worker adds nothing.
        self.accumulate_on_gpu = False
        # Per chunk: the worker's last task that reads or writes its host gradients (an
        # accumulation, an update, a zero_grad's clear), which a GPU update of them waits for;
        # the worker runs its tasks in order, so it also covers every earlier task on the
        # chunk. Unlike the store's ``host_busy`` (work on the chunk's weights or state), an
        # accumulation does not hold back the next forward's gather of the weights.
        self.grads_busy: dict[int, Future] = {}
        # Seconds the worker spent on host gradients; of them, gradient accumulation's adds (a
        # micro-batch's gradients onto the earlier ones') and their elements, for the cost
        # model's ``cpu_accumulate_params_per_s``; of those, the elements copied out of an
        # aliased staging (``_unalias``).
        self.busy_s = 0.0
        self.add_s = 0.0
        self.added_params = 0
        self.copied_params = 0

    def set_accumulate_on_gpu(self, on: bool) -> None:
        """Whether the plan sums gradient accumulation on the GPU (``device_sums``)."""
        self.accumulate_on_gpu = on

    def receive(
        self,
        chunk: Chunk,
        slots: list[ParamSlot],
        event: torch.cuda.Event | None,
        norms: tuple[torch.Tensor, ...] = (),
        presence: torch.Tensor | None = None,
        summed: bool = False,
    ) -> None:
        """``chunk``'s gradients of ``slots`` are on their way into the staging (done at
        ``event``, taken with ``norms`` on the device): queue them into the host gradients.
        ``presence`` (data parallel): per slot, 0 where no rank had a gradient, read once
        ``event`` is done; those slots get no host gradient. ``summed``: the staging holds
        every backward's sum since zero_grad (``device_sums``): it stays the host gradient."""
        for slot, norm in zip(slots, norms, strict=False):
            pid = id(slot.param)
            self.accumulations[pid] = self.accumulations.get(pid, 0) + 1
            self._grad_norms.record(pid, norm, whole=summed or self.accumulations[pid] == 1)
        alias = summed or all(self._aliasable(slot) for slot in slots)
        if alias:
            self.aliased.add(chunk.index)
            self.zeroed_in_staging.discard(chunk.index)
        future = self._worker.submit(self._accumulate, chunk, slots, event, alias, presence)
        self._offload.staging_busy.set(chunk.index, future)
        self.grads_busy[chunk.index] = future

    def holds_gradients(self, chunk: Chunk) -> bool:
        """Whether any of ``chunk``'s params has a host gradient since its last ``zero_grad``."""
        return any(self.accumulations.get(id(slot.param), 0) for slot in chunk.trainable_slots)

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
            self.before_staging_write(index)

    def _aliasable(self, slot: ParamSlot) -> bool:
        """Whether ``slot``'s host gradient can be its staging: the first backward since
        zero_grad (nothing to add to) and a master of the gradient's dtype."""
        pid = id(slot.param)
        master = self._masters.get(pid)
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
            master = self._masters[id(slot.param)]
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
        view = self._staged_views.get(id(slot.param))
        if view is None:
            view = self._offload.staging_view(slot, chunk)
            self._staged_views[id(slot.param)] = view
        return view

    def before_staging_write(self, index: int) -> None:
        """Chunk ``index``'s staging is about to be overwritten (a second backward before
        ``zero_grad``): copy the gradients aliased to it out first, on the worker in order."""
        if index not in self.aliased:
            return
        self.aliased.discard(index)
        chunk = self._offload.chunks[index]
        future = self._worker.submit(self._unalias, chunk)
        self._offload.staging_busy.set(index, future)
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
            master = self._masters.get(id(slot.param))
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

    def adopt(self, slot: ParamSlot, master: torch.Tensor, grad: torch.Tensor) -> None:
        """``slot``'s param was just offloaded with ``grad`` on the device: it becomes the host
        gradient, one backward's worth (the next one adds to it; its norm is taken on the host).
        The worker is idle (the caller waited)."""
        buffer = self._grad_buffer(slot, master)
        buffer.copy_(grad.detach().view(buffer.shape))
        master.grad = buffer
        self.accumulations[id(slot.param)] = 1
        self._grad_norms.forget({id(slot.param)})

    def hold_staging(self, index: int, future: Future) -> None:
        """An aliased chunk's staging is read by ``future`` (its update, or the zero_grad clear):
        the next write into it waits for that."""
        if index in self.aliased or index in self.zeroed_in_staging:
            self._offload.staging_busy.set(index, future)

    def read_by(self, index: int, future: Future) -> None:
        """Chunk ``index``'s host gradients are read by ``future``, a task of the worker (its
        update): later work on them, and on an aliased staging, waits for it."""
        self.grads_busy[index] = future
        self.hold_staging(index, future)

    def zero_grad(self, set_to_none: bool = True, param_ids: set[int] | None = None) -> None:
        """Forget the accumulated host gradients (the user's ``zero_grad``); returns at once.

        ``param_ids``: only those params' (an optimizer's ``zero_grad`` clears its own params,
        as torch's does); None: every offloaded param's (``model.zero_grad()``).

        The clearing is queued on the worker behind the updates still running, so the next
        forward overlaps them: waiting here (as ``step(); zero_grad()`` loops call it right
        after the step) put the whole CPU update on the critical path (3.2B: a 308 ms idle GPU
        per step). Everything that reads host gradients waits for the worker first."""
        if param_ids is not None and not self._grad_norms.covers_all(param_ids):
            self._zero_some(set_to_none, param_ids)
            return
        masters = self._masters

        def clear() -> None:
            for master in masters.values():
                if set_to_none:
                    master.grad = None
                elif master.grad is not None:
                    master.grad.zero_()

        future = self._worker.submit(clear)
        # The clear drops (or zeroes) gradients aliased to staging: the next writes wait for it.
        in_staging = self.aliased | self.zeroed_in_staging
        for index in in_staging:
            self._offload.staging_busy.set(index, future)
        # Zeroed, they stay the staging: a later clear or update still touches it.
        self.zeroed_in_staging = set() if set_to_none else in_staging
        # A GPU update of a chunk reads its host gradients on the update thread, after its
        # ``grads_busy``: the clear is now the last task on them (a step with no backward since
        # would otherwise read the gradients the clear drops). One dict write per chunk.
        for index in range(len(self._offload.chunks)):
            self.grads_busy[index] = future
        self.aliased.clear()
        self.accumulations.clear()
        self._grad_norms.clear()

    def _zero_some(self, set_to_none: bool, param_ids: set[int]) -> None:
        """``zero_grad`` of part of the offloaded params: the others keep accumulating."""
        self._grad_norms.host_grads()  # a pending clipping coefficient applies to the kept ones too
        for chunk in self._offload.chunks:
            # The kept gradients must not be the staging the next backward writes into.
            if chunk.index in self.aliased:
                self.before_staging_write(chunk.index)
        cleared = [m for pid, m in self._masters.items() if pid in param_ids]

        def clear() -> None:
            for master in cleared:
                if set_to_none:
                    master.grad = None
                elif master.grad is not None:
                    master.grad.zero_()

        future = self._worker.submit(clear)
        for index in self.zeroed_in_staging:
            self._offload.staging_busy.set(index, future)
        for chunk in self._offload.chunks:
            if any(id(slot.param) in param_ids for slot in chunk.trainable_slots):
                self.grads_busy[chunk.index] = future  # as in zero_grad
        for pid in param_ids:
            self.accumulations.pop(pid, None)
        self._grad_norms.forget(param_ids)

    def forget_chunk(self, chunk: Chunk) -> None:
        """``chunk`` left the CPU optimizer (it became persistent): drop its host gradients."""
        self.aliased.discard(chunk.index)
        self.zeroed_in_staging.discard(chunk.index)
        self.grads_busy.pop(chunk.index, None)
        for slot in chunk.slots:
            pid = id(slot.param)
            self._staged_views.pop(pid, None)
            self.add_views.pop(pid, None)
            self.grad_buffers.pop(pid, None)
            self.accumulations.pop(pid, None)
        self._grad_norms.forget({id(slot.param) for slot in chunk.slots})

    def clear(self) -> None:
        """Detach: drop every host tensor held here (views of the pinned staging included)."""
        for table in (self.grad_buffers, self._staged_views, self.add_views, self.grads_busy):
            table.clear()
        self.aliased.clear()
        self.zeroed_in_staging.clear()
        self.accumulations.clear()
