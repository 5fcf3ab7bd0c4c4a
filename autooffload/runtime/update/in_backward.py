"""The update in the backward: what it updated before ``optimizer.step()`` and the checks that the
step then applies the same update (``EarlyUpdates``), and its updates that do not run on the
worker: offloaded chunks on the GPU while still resident, persistent chunks with their own
optimizers (``BackwardUpdates``). The worker's updates in the backward are queued by
``CpuOptimizer`` as the gradients arrive.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from autooffload.errors import UpdateInBackwardError
from autooffload.runtime.chunks.layout import Chunk, ParamSlot
from autooffload.runtime.chunks.store import Residency
from autooffload.runtime.update.persistent_update import step_params
from autooffload.runtime.update.twins import Twins, twin_group

if TYPE_CHECKING:
    from autooffload.runtime.chunks.store import ChunkManager
    from autooffload.runtime.control.calibration import DeviceUpdateTimer
    from autooffload.runtime.parallel.distributed import Reduction
    from autooffload.runtime.update.gpu_update import GpuUpdater
    from autooffload.runtime.update.host_grads import HostGradNorms

Optimizer = torch.optim.Optimizer

# Why a chunk is left to ``step()`` and the auto mode turns off: its params held gradients of an
# earlier backward that no step of their optimizer used (one optimizer stepping less often than
# another), which only the sum at ``step()`` gives.
ACCUMULATED = "a backward added to gradients that no optimizer step used yet"
# Why a chunk is left to ``step()`` and the auto mode turns off: two live optimizers hold its
# params, and each steps them with its own state at its own ``step()``, whichever runs.
SHARED = (
    "two optimizers hold the same parameters (each steps them with its own state at its"
    " optimizer.step())"
)


class EarlyUpdates:
    """The chunks updated in this backward, before ``optimizer.step()``, and the checks that the
    step then applies the same update; and what the loop did between a backward and its step
    that such an update could not honour (the auto mode's evidence, ``update_mode.py``)."""

    def __init__(self, twins: Twins) -> None:
        self._twins = twins
        # Offloaded chunks updated in this backward: the optimizer and hyperparameters used.
        self.offloaded: dict[int, tuple[Optimizer, list[dict]]] = {}
        # Persistent chunks stepped in this backward (runtime/update/persistent_update.py): per
        # chunk, each owner, the indices of its groups stepped and their hyperparameters.
        self.persistent: dict[int, list[tuple[Optimizer, list[int], list[dict]]]] = {}
        # What turned the update in the backward on (named in the errors).
        self.origin = "AUTOOFFLOAD_UPDATE_IN_BACKWARD=1"
        # The loop as the auto mode observes it: a backward since the last step, what the loop
        # did between a backward and its step that an update in the backward could not honour,
        # and (while ``observing``) the hyperparameters of every bound optimizer when the
        # step's first gradients arrived.
        self.backward_since_step = False
        self.loop_reasons: set[str] = set()
        self.observing = False
        self._hyper_at_backward: dict[int, list[dict]] | None = None

    @property
    def count(self) -> int:
        """Chunks updated in this backward, offloaded and persistent."""
        return len(self.offloaded) + len(self.persistent)

    def set_origin(self, origin: str) -> None:
        """Name what turned the update in the backward on (the setting, or the auto mode)."""
        self.origin = origin

    def observe(self, on: bool) -> None:
        """Start or stop noting the hyperparameters at each step's first gradients."""
        self.observing = on

    def add_reason(self, reason: str) -> None:
        """The loop did something the update in the backward could not honour."""
        self.loop_reasons.add(reason)

    def step_done(self) -> None:
        """The runtime's step ended: a new stretch between a backward and its step begins (the
        reasons seen stay while observing, for the auto mode to decide on)."""
        if not self.observing:
            self.loop_reasons.clear()
        self.backward_since_step = False
        self._hyper_at_backward = None

    def discard_backward(self) -> None:
        """The backward since the last step was discarded (an OOM retry clears its gradients):
        what comes next is not between a backward and its step."""
        self.backward_since_step = False

    def note_gradients(self, chunk: Chunk) -> None:
        """Gradients of ``chunk`` are in: raise if it was updated in this step's backward
        already; note the backward (and, observing, the hyperparameters now)."""
        if chunk.index in self.offloaded:
            raise UpdateInBackwardError(
                f"a second backward reached chunk {chunk.index} before optimizer.step(), but"
                f" the update in the backward ({self.origin}) already"
                " applied its update in the first: gradient accumulation needs"
                " AUTOOFFLOAD_UPDATE_IN_BACKWARD=0"
            )
        if self.observing and self._hyper_at_backward is None:
            self._hyper_at_backward = {
                id(o): [twin_group(g, type(o)) for g in o.param_groups]
                for o in self._twins.optimizers
            }
        self.backward_since_step = True

    def check_no_early_update(self, what: str) -> None:
        """Raise if a chunk was updated in this backward: ``what`` needs the gradients before
        any update. Between a backward and its step, ``what`` is also a reason the loop cannot
        take the update in the backward (``loop_reasons``, for the auto mode)."""
        self._refuse_after_update(
            what,
            "chunks with that backward's raw gradients (not unscaled by a GradScaler, not"
            " clipped); optimizer.step() applies the rest of that update, and"
            " AUTOOFFLOAD_UPDATE_IN_BACKWARD=0 suits loops that clip, use a GradScaler, skip"
            " steps or read the gradients before step()",
        )

    def check_no_early_read(self, what: str) -> None:
        """Raise if a chunk was updated in this backward: ``what`` reads the weights, which
        plain PyTorch has unchanged until ``optimizer.step()``. Between a backward and its
        step, ``what`` is also a reason the loop cannot take the update in the backward."""
        self._refuse_after_update(
            what,
            "chunks: it would read the weights of the step that optimizer.step() has not made"
            " yet; read them after optimizer.step(), or set AUTOOFFLOAD_UPDATE_IN_BACKWARD=0 for"
            " loops that accumulate gradients, evaluate, generate or read the weights between"
            " backward and step()",
        )

    def _refuse_after_update(self, what: str, consequence: str) -> None:
        if self.backward_since_step:
            self.loop_reasons.add(what)
        if self.count:
            raise UpdateInBackwardError(
                f"{what} after a backward in which the update in the backward"
                f" ({self.origin}) already updated {self.count} {consequence}"
            )

    def record(self, index: int, optimizer: Optimizer, hyper: list[dict]) -> None:
        """Offloaded chunk ``index`` is being updated in this backward, with ``hyper``."""
        self.offloaded[index] = (optimizer, hyper)

    def record_persistent(
        self, index: int, entries: list[tuple[Optimizer, list[int], list[dict]]]
    ) -> None:
        """Persistent chunk ``index`` was stepped in this backward (per owner: its groups
        stepped and their hyperparameters)."""
        self.persistent[index] = entries

    def settle(self, index: int, optimizer: Optimizer, hyper: list[dict]) -> bool:
        """At ``optimizer.step()``, chunk ``index``'s update with ``hyper``: True if the update
        in the backward made it already with ``optimizer`` (raise if with other
        hyperparameters)."""
        early = self.offloaded.get(index)
        if early is None or early[0] is not optimizer:
            return False
        del self.offloaded[index]
        if early[1] != hyper:
            raise UpdateInBackwardError(
                f"optimizer.step() runs chunk {index} with hyperparameters"
                f" {hyper} but the update in the backward"
                f" ({self.origin}) updated it during backward with"
                f" {early[1]}; change them before backward (schedulers stepping after"
                " optimizer.step() do) or set AUTOOFFLOAD_UPDATE_IN_BACKWARD=0"
            )
        return True

    def settle_persistent(self, optimizer: Optimizer) -> None:
        """At ``optimizer.step()``: its persistent params were stepped in the backward (the
        step skipped them, having no gradient); raise if that used other hyperparameters."""
        for index in list(self.persistent):
            kept = []
            for owner, groups, hyper in self.persistent[index]:
                if owner is not optimizer:
                    kept.append((owner, groups, hyper))
                    continue
                now = [twin_group(optimizer.param_groups[g], type(optimizer)) for g in groups]
                if now != hyper:
                    del self.persistent[index]
                    raise UpdateInBackwardError(
                        f"optimizer.step() runs with hyperparameters {now} but the update in the"
                        f" backward ({self.origin}) stepped persistent chunk"
                        f" {index} during backward with {hyper}; change them before backward"
                        " (schedulers stepping after optimizer.step() do) or set"
                        " AUTOOFFLOAD_UPDATE_IN_BACKWARD=0"
                    )
            if kept:
                self.persistent[index] = kept
            else:
                del self.persistent[index]

    def note_step_hyper(self, optimizer: Optimizer) -> None:
        """At ``optimizer.step()`` while observing: hyperparameters changed since the step's
        first gradients arrived are a reason against the update in the backward (it would
        have used the old ones)."""
        before = (self._hyper_at_backward or {}).get(id(optimizer))
        if before is None:
            return
        now = [twin_group(g, type(optimizer)) for g in optimizer.param_groups]
        if now != before:
            self.loop_reasons.add("hyperparameters changed between backward and optimizer.step()")

    def clear(self) -> None:
        """Detach: forget the chunks updated early."""
        self.offloaded.clear()
        self.persistent.clear()


class BackwardUpdates:
    """The updates in the backward that do not run on the worker (offloaded chunks on the GPU,
    persistent chunks with their optimizers), armed step by step (``update_mode.py``)."""

    def __init__(
        self,
        manager: ChunkManager,
        gpu: GpuUpdater,
        twins: Twins,
        masters: dict[int, torch.Tensor],
        early: EarlyUpdates,
        grad_norms: HostGradNorms,
        gpu_problem: Callable[[Optimizer], str | None],
        holds_gradients: Callable[[Chunk], bool],
    ) -> None:
        """``gpu_problem``: why an optimizer's chunks cannot take the GPU path in the backward
        (``CpuOptimizer.gpu_path_problem``), None if they can; ``holds_gradients``: whether an
        offloaded chunk's params have host gradients of an earlier backward."""
        self._manager = manager
        self._gpu = gpu
        self._twins = twins
        self._masters = masters
        self._early = early
        self._grad_norms = grad_norms
        self._gpu_problem = gpu_problem
        self._holds_gradients = holds_gradients
        # Persistent chunks whose params had gradients when this backward began.
        self._carried: set[int] = set()
        # AUTOOFFLOAD_UPDATE_IN_BACKWARD: armed by the runtime once the plan is searched, for
        # offloaded chunks (the worker's too) and for persistent ones.
        self.armed = False
        self.persistent_armed = False
        # The chunks the GPU updates at the end of their backward, weights and gradients still
        # resident (plan/update_split.backward_split).
        self.gpu_chunks: set[int] = set()
        # Times the persistent chunks' updates here, as at step() (set by the calibration's
        # window: runtime/control/calibration.py).
        self.device_timer: DeviceUpdateTimer | None = None

    def close(self) -> None:
        """At detach: no ``gpu_problem`` of the CPU optimizer (a cycle through it that would
        keep its params and host tensors alive until a cyclic gc)."""
        del self._gpu_problem

    def arm(self, offloaded: bool | None = None, persistent: bool | None = None) -> None:
        """Turn the update in the backward of offloaded chunks and of persistent chunks on or
        off (None: leave it as it is)."""
        if offloaded is not None:
            self.armed = offloaded
        if persistent is not None:
            self.persistent_armed = persistent

    def begin_backward(self, persistent: list[Chunk]) -> None:
        """A backward begins: note the ``persistent`` chunks whose params hold gradients already
        (an earlier backward's that no step used), which ``update_persistent`` leaves to
        ``step()``. Zeros left by ``zero_grad(set_to_none=False)`` are no such gradient."""
        held = {
            chunk.index: [s.param.grad for s in chunk.trainable_slots if s.param.grad is not None]
            for chunk in persistent
        }
        held = {index: grads for index, grads in held.items() if grads}
        if not held:
            self._carried = set()  # the update in the backward leaves none: no device sync
            return
        nonzero = torch.stack(
            [torch.stack([g.ne(0).any() for g in gs]).any() for gs in held.values()]
        )
        self._carried = {index for index, flag in zip(held, nonzero.tolist(), strict=True) if flag}

    def set_gpu_chunks(self, indices: set[int]) -> None:
        """The offloaded chunks the GPU updates in the backward (the plan's lowest ones)."""
        self.gpu_chunks = indices

    def _device_update_owner(self, chunk: Chunk) -> tuple[Optimizer, Optimizer] | None:
        """(optimizer, twin) when the GPU updates ``chunk`` in this backward: the plan gives
        it the chunk, the update in the backward is armed, one bound optimizer owns it and
        the GPU path can run it; None where the chunk's gradients go to the CPU instead (which
        trains alike)."""
        if not self.armed or chunk.index not in self.gpu_chunks:
            return None
        if self._grad_norms.clip_coef != 1.0 or self._manager.is_persistent(chunk.index):
            return None
        optimizer = self._twins.sole_owner(chunk)
        if optimizer is None or self._gpu_problem(optimizer) is not None:
            return None
        twin = self._twins.twin(chunk, optimizer)
        return None if twin is None else (optimizer, twin)

    def load_state(self, chunk: Chunk) -> None:
        """The backward nears ``chunk``: if the GPU updates it there, start copying its
        optimizer state in (``GpuUpdater.load_state``)."""
        if chunk.index in self._early.offloaded or chunk.index in self._gpu.loaded:
            return
        found = self._device_update_owner(chunk)
        if found is not None:
            self._gpu.load_state(chunk, found[1])

    def update_on_device(self, chunk: Chunk) -> bool:
        """``chunk``'s backward is complete: update it on the GPU now if the plan gives it
        to the GPU in the backward (``GpuUpdater.update_resident``), its gradients dropped;
        False where its gradients go to the host as usual."""
        if self._manager.state[chunk.index] != Residency.RESIDENT:
            return False
        if self._manager.grads.data_parallel is not None:
            return False  # after the average: ``update_averaged_on_device``
        slots = [s for s in chunk.trainable_slots if s.param.grad is not None]
        if self._holds_gradients(chunk):
            return False  # the sum is on the host: the worker's path sees it
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
        if found is None or self._manager.state[chunk.index] != Residency.RESIDENT:
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
        optimizer: Optimizer,
        twin: Optimizer,
        slots: list[ParamSlot],
        **kwargs: Any,
    ) -> None:
        """Start ``GpuUpdater.update_resident`` of ``chunk``'s ``slots`` (``kwargs``: its
        gradients, when not their ``.grad``) as an update in this backward."""
        self._early.note_gradients(chunk)
        hyper = self._twins.hyper(chunk, optimizer)
        self._early.record(chunk.index, optimizer, hyper)
        self._manager.before_host_write(chunk.index)
        pairs = [(self._masters[id(s.param)], s) for s in slots]
        future = self._gpu.update_resident(chunk, twin, hyper, pairs, **kwargs)
        self._manager.host_busy.set(chunk.index, future)

    def update_persistent(self, chunk: Chunk) -> None:
        """Persistent ``chunk``'s backward is complete: step its params that have a gradient
        with their optimizers now and drop the gradients (runtime/update/persistent_update.py)."""
        with_grad = [s.param for s in chunk.trainable_slots if s.param.grad is not None]
        if not with_grad:
            return
        if chunk.index in self._early.persistent:
            raise UpdateInBackwardError(
                f"gradients reached persistent chunk {chunk.index} after the update in the"
                f" backward ({self._early.origin}) applied its update (a second"
                " backward before optimizer.step(), as gradient accumulation runs): set"
                " AUTOOFFLOAD_UPDATE_IN_BACKWARD=0"
            )
        if chunk.index in self._carried:
            self._early.add_reason(ACCUMULATED)
            return
        by_owner: dict[int, tuple[Optimizer, set[int]]] = {}
        for param in with_grad:
            owners = self._twins.owners(id(param))
            if len(owners) > 1:
                # Each steps it with its own state at its step(): left to them.
                self._early.add_reason(SHARED)
                return
            if owners:
                by_owner.setdefault(id(owners[0]), (owners[0], set()))[1].add(id(param))
        entries = []
        timer = self.device_timer
        if timer is not None:
            timer.start(
                sum(p.numel() for p in with_grad if any(id(p) in i for _, i in by_owner.values()))
            )
        for owner, ids in by_owner.values():
            groups = step_params(owner, ids)
            hyper = [twin_group(owner.param_groups[g], type(owner)) for g in groups]
            entries.append((owner, groups, hyper))
            for param in with_grad:
                if id(param) in ids:
                    param.grad = None
        if timer is not None:
            timer.stop(True)
        if entries:
            self._early.record_persistent(chunk.index, entries)
