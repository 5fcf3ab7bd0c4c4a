"""The update in the backward: offloaded chunks updated as their gradients arrive (on the worker,
or on the GPU while still resident), persistent chunks stepped with their optimizers, and the
checks that ``optimizer.step()`` then applies the same update.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from autooffload.errors import UpdateInBackwardError
from autooffload.runtime.chunks.layout import Chunk, ParamSlot
from autooffload.runtime.chunks.store import Residency
from autooffload.runtime.update.persistent_update import step_params
from autooffload.runtime.update.twins import twin_group

if TYPE_CHECKING:
    from autooffload.runtime.chunks.store import ChunkManager
    from autooffload.runtime.distributed import Reduction
    from autooffload.runtime.update.gpu_update import GpuUpdater


class BackwardUpdates:
    """Updates in the backward of a model's chunks (state owned by ``CpuOptimizer``)."""

    manager: ChunkManager
    worker: ThreadPoolExecutor
    gpu: GpuUpdater
    masters: dict[int, torch.Tensor]
    optimizer_of_param: dict[int, torch.optim.Optimizer]
    twin_group_index: dict[tuple[int, int], list[int]]
    backward_gpu_chunks: set[int]
    _gpu_problems: dict[int, str | None]
    early: dict[int, tuple[torch.optim.Optimizer, list[dict]]]
    persistent_early: dict[int, list[tuple[torch.optim.Optimizer, list[int], list[dict]]]]
    update_in_backward: bool
    update_in_backward_origin: str
    backward_since_step: bool
    loop_reasons: set[str]
    hyper_at_backward: dict[int, list[dict]] | None
    clip_coef: float
    updates_in_backward: int

    if TYPE_CHECKING:  # CpuOptimizer's and its other parts'

        def _note_gradients(self, chunk: Chunk) -> None: ...

        def _twin(
            self, chunk: Chunk, optimizer: torch.optim.Optimizer
        ) -> torch.optim.Optimizer | None: ...

        def _queue_update(
            self, chunk: Chunk, twin: torch.optim.Optimizer, hyper: list[dict], clip_coef: float
        ) -> None: ...

        def gpu_path_problem(
            self, optimizer: torch.optim.Optimizer, in_backward: bool = False
        ) -> str | None: ...

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
        if self.manager.grads.data_parallel is not None:
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
        self.manager.host_busy.set(chunk.index, future)

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
            twin_group(optimizer.param_groups[g], type(optimizer))
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
            hyper = [twin_group(owner.param_groups[g], type(owner)) for g in groups]
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
                now = [twin_group(optimizer.param_groups[g], type(optimizer)) for g in groups]
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
        now = [twin_group(g, type(optimizer)) for g in optimizer.param_groups]
        if now != before:
            self.loop_reasons.add("hyperparameters changed between backward and optimizer.step()")
