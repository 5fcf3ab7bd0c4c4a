"""Gradient staging and accumulation: offloaded params' gradients from their pinned staging into
host gradients on the worker, aliased to the staging where they can be, and cleared at zero_grad.

The first backward after ``zero_grad`` leaves a chunk's gradients in its staging, and where the
masters have the gradients' dtype the host gradients are the staging itself (``aliased``): no
copy. A later backward (gradient accumulation) would overwrite that staging: the aliased
gradients are copied out first (``_before_staging_write``, queued on the worker, at the next
forward already: ``release_staging``), and the new gradients are added on the worker. Under
accumulation on the GPU the staging keeps the running sum, which the device adds to.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from autooffload.errors import UpdateInBackwardError
from autooffload.runtime.chunks.layout import Chunk, ParamSlot
from autooffload.runtime.update.twins import twin_group

if TYPE_CHECKING:
    from autooffload.runtime.chunks.store import ChunkManager

# Gradient accumulation adds a micro-batch's staged gradients (the model's dtype) onto fp32
# host gradients. torch adds mixed dtypes by casting the whole staged tensor into a new fp32
# temporary first: for a 64M-element tensor that is a fresh allocation, page faults included,
# per add (16 cores: 2.1 Gparam/s, against 10 for fp32 + fp32). Views of ACCUMULATE_BLOCK
# elements keep each temporary small and reused by the allocator (devtools/host_accumulate_rate.py).
ACCUMULATE_BLOCK = 1 << 20


class GradStaging:
    """Host gradients of a model's offloaded params, from the staging (state owned by
    ``CpuOptimizer``)."""

    manager: ChunkManager
    worker: ThreadPoolExecutor
    masters: dict[int, torch.Tensor]
    optimizers: list[torch.optim.Optimizer]
    accumulations: dict[int, int]
    device_norms: dict[int, torch.Tensor]
    norm_of_sum: set[int]
    aliased: set[int]
    grads_busy: dict[int, Future]
    grad_buffers: dict[int, torch.Tensor]
    staged_views: dict[int, torch.Tensor]
    add_views: dict[int, tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]]
    early: dict[int, tuple[torch.optim.Optimizer, list[dict]]]
    accumulate_on_gpu: bool
    update_in_backward: bool
    update_in_backward_origin: str
    observing: bool
    hyper_at_backward: dict[int, list[dict]] | None
    backward_since_step: bool
    clip_coef: float
    busy_s: float
    add_s: float
    added_params: int
    copied_params: int

    if TYPE_CHECKING:  # CpuOptimizer's and its other parts'

        def _update_now(self, chunk: Chunk) -> None: ...

        def check_no_early_update(self, what: str) -> None: ...

        def covers_all(self, param_ids: set[int]) -> bool: ...

        def host_grads(self) -> list[torch.Tensor]: ...

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
        self.manager.grads.staging_busy.set(chunk.index, future)
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
                id(o): [twin_group(g, type(o)) for g in o.param_groups] for o in self.optimizers
            }
        self.backward_since_step = True

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
            view = self.manager.grads.staging_view(slot, chunk)
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
        self.manager.grads.staging_busy.set(index, future)
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
            self.manager.grads.staging_busy.set(index, future)

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
            self.manager.grads.staging_busy.set(index, future)
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
