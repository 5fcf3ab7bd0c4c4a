"""Updates of offloaded chunks on the GPU, their optimizer state streamed from pinned memory.

When the step is bound by the CPU optimizer, the PCIe link idles most of the step. For the
chunks the plan names (``plan/update_split.py``: the last offloaded ones, which the next forward
needs last), ``optimizer.step()`` queues this path instead of the CPU's, and both run at once:

    in stream:   weights (the chunk's host bytes), gradients, state (one pinned arena per chunk)
                 and ``step`` counts H2D into one of two scratch sets
    out stream:  torch's fused Adam/AdamW on the scratch (the user's hyperparameters, gradients
                 scaled by a pending clipping coefficient), then weights and state D2H

Chunk j+1's copies in overlap chunk j's update and copies out. A chunk's future (the manager's
``host_busy``) completes when its bytes are back on the host, so the next forward's gather of
it waits exactly as it waits for a CPU update. The CPU twin's state stays the state of record
(checkpoints, plan switches, the CPU path): its tensors become views of the chunk's pinned
arena, and its ``step`` counts are advanced here. On a CPU device (tests) the same code runs
synchronously on CPU tensors.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.optim.adam import adam

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from autooffload.runtime.chunks.layout import Chunk, ParamSlot
    from autooffload.runtime.chunks.store import ChunkManager

_ALIGN = 256


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def state_keys(group: dict) -> tuple[str, ...]:
    """Adam's per-element state tensors for a group's params."""
    return (
        ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
        if group.get("amsgrad")
        else (
            "exp_avg",
            "exp_avg_sq",
        )
    )


@dataclass
class _Task:
    chunk: Chunk
    twin: torch.optim.Optimizer
    hyper: list[dict]
    clip_coef: float
    after: Future | None
    future: Future
    scratch: torch.Tensor
    slot: int


class GpuUpdater:
    """The GPU update path of a ``CpuOptimizer`` (see the module docstring)."""

    def __init__(self, manager: ChunkManager) -> None:
        self.manager = manager
        self.is_cuda = manager.is_cuda
        device = manager.device
        self.thread = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="autooffload-gpu-update",
            initializer=(lambda: torch.cuda.set_device(device)) if self.is_cuda else None,
        )
        if self.is_cuda:
            self.in_stream = torch.cuda.Stream(device)
            self.out_stream = torch.cuda.Stream(device)
        # Per chunk index: the pinned arena of its twin's state tensors, and their offsets.
        self.arenas: dict[int, torch.Tensor] = {}
        self.offsets: dict[int, dict[tuple[int, str], int]] = {}
        # Per chunk index: its trainable slots by the address of their host bytes.
        self.slots: dict[int, dict[int, ParamSlot]] = {}
        # On the thread: the chunk whose copies out are in flight, and per scratch set the
        # event after which it may be overwritten.
        self._inflight: tuple[Future, torch.cuda.Event | None] | None = None
        self._set_free: list[torch.cuda.Event | None] = [None, None]
        self.last_flush: Future | None = None
        # The update in the backward (``update_resident``): per chunk index, its state on the
        # device (copied in ahead, ``load_state``) and the event after its copy in; and the
        # event after the last copy of its state out, which the next copy in waits for.
        self.loaded: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        self.state_out: dict[int, torch.cuda.Event] = {}
        self.busy_s = 0.0
        self.updated_params = 0
        self.updates = 0

    # ---- state arena --------------------------------------------------------------------------

    def _arena(self, chunk: Chunk, twin: torch.optim.Optimizer) -> torch.Tensor:
        """The chunk's pinned state arena; the twin's state tensors made views of it (values
        kept: a state loaded from a checkpoint, or left by a CPU update, is copied in)."""
        offsets = self.offsets.get(chunk.index)
        if offsets is None:
            # The twin's state is read and copied in below: a CPU update of the chunk still
            # running on the worker writes it (only the first time: the arena is the state then).
            busy = self.manager.host_busy.get(chunk.index)
            if busy is not None:
                busy.result()
            offsets, size = {}, 0
            for group in twin.param_groups:
                for master in group["params"]:
                    for key in state_keys(group):
                        offsets[(id(master), key)] = size
                        size += _aligned(master.numel() * master.element_size())
            pin = self.is_cuda and torch.cuda.is_available()
            self.arenas[chunk.index] = torch.zeros(size, dtype=torch.uint8, pin_memory=pin)
            self.offsets[chunk.index] = offsets
        arena = self.arenas[chunk.index]
        for group in twin.param_groups:
            for master in group["params"]:
                state = twin.state[master]
                if "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                for key in state_keys(group):
                    start = offsets[(id(master), key)]
                    nbytes = master.numel() * master.element_size()
                    view = arena[start : start + nbytes].view(master.dtype).view(master.shape)
                    current = state.get(key)
                    if current is None:
                        view.zero_()
                    elif current.data_ptr() != view.data_ptr():
                        view.copy_(current)
                    state[key] = view
        return arena

    @staticmethod
    def scratch_bytes(chunk: Chunk, arena_bytes: int) -> int:
        """Device bytes of one scratch set for ``chunk``: weights, gradients (laid out as the
        weights), the state arena, the ``step`` counts."""
        return 2 * _aligned(chunk.nbytes) + _aligned(arena_bytes) + _ALIGN * 4

    # ---- queueing (main thread) -----------------------------------------------------------------

    def queue(
        self,
        items: list[tuple[Chunk, torch.optim.Optimizer, list[dict], Future | None]],
        clip_coef: float,
    ) -> list[Future]:
        """Queue the updates of ``items`` (chunk, twin, hyperparameters, the future its gradients
        wait on), in order; one future per item, done when the chunk's host bytes are new."""
        arenas = [self._arena(chunk, twin) for chunk, twin, _, _ in items]
        size = max(self.scratch_bytes(c, a.numel()) for (c, *_), a in zip(items, arenas))
        device = self.manager.device
        # Allocated here, on the compute stream's pool (freed activations are reused); the in
        # stream starts after what the compute stream has queued so far.
        sets = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2)]
        start = None
        if self.is_cuda:
            start = torch.cuda.Event()
            start.record()
        futures = []
        for position, (chunk, twin, hyper, after) in enumerate(items):
            future: Future = Future()
            task = _Task(chunk, twin, hyper, clip_coef, after, future, sets[position % 2], position)
            self.thread.submit(self._run, task, start if position == 0 else None)
            futures.append(future)
        del sets
        self.last_flush = self.thread.submit(self._flush)
        return futures

    def wait(self) -> None:
        """Block until every queued update is done."""
        self.thread.submit(lambda: None).result()

    def shutdown(self) -> None:
        self.thread.shutdown(wait=True)
        self.loaded.clear()
        self.state_out.clear()
        self.arenas.clear()
        self.offsets.clear()
        self.slots.clear()
        self.last_flush = None

    # ---- the update in the backward (main thread) ---------------------------------------------

    def load_state(self, chunk: Chunk, twin: torch.optim.Optimizer) -> None:
        """Start copying ``chunk``'s optimizer state to the device for ``update_resident``
        (on the in stream, behind the compute queued so far: its scratch comes from the
        compute stream's pool, where the backward frees activations)."""
        if chunk.index in self.loaded:
            return
        busy = self.manager.host_busy.get(chunk.index)
        if busy is not None:
            busy.result()  # a CPU update of the chunk (a step without this path) writes the state
        arena = self._arena(chunk, twin)
        scratch = torch.empty(arena.numel(), dtype=torch.uint8, device=self.manager.device)
        loaded = None
        if self.is_cuda:
            self.in_stream.wait_stream(torch.cuda.current_stream(self.manager.device))
            previous = self.state_out.get(chunk.index)
            if previous is not None:
                self.in_stream.wait_event(previous)
            with torch.cuda.stream(self.in_stream):
                scratch.copy_(arena, non_blocking=True)
                loaded = torch.cuda.Event()
                loaded.record()
        else:
            scratch.copy_(arena)
        self.loaded[chunk.index] = (scratch, loaded)

    def drop_loaded(self) -> None:
        """Forget states copied in for a backward that did not reach their update."""
        if self.is_cuda and self.loaded:
            torch.cuda.current_stream(self.manager.device).wait_stream(self.in_stream)
        self.loaded.clear()

    def update_resident(
        self,
        chunk: Chunk,
        twin: torch.optim.Optimizer,
        hyper: list[dict],
        pairs: list[tuple[torch.Tensor, ParamSlot]],
        grads: list[torch.Tensor] | None = None,
        after: Callable[[], None] | None = None,
        keep: Sequence[torch.Tensor] = (),
    ) -> Future:
        """Update resident ``chunk`` with its gradients on the device (of ``pairs``: the twin's
        param, the host bytes, and its slot, whose ``.grad`` is on the device; or ``grads``,
        one per pair) and its state (``load_state``): the kernels run on the out stream, behind
        the compute queued so far (and ``after``, called on it: a collective's wait), on the
        chunk's device bytes in place; then its weights and state go to the host. The future
        is done once they are there. The caller drops the gradients; ``keep``: more tensors
        the kernels read (kept until the out stream is past them)."""
        began = time.perf_counter()
        if chunk.index not in self.loaded:
            self.load_state(chunk, twin)
        scratch, loaded = self.loaded.pop(chunk.index)
        arena = self.arenas[chunk.index]
        offsets = self.offsets[chunk.index]
        flat = self.manager.gpu_flat[chunk.index]
        host = self.manager.host.view(chunk.index)
        masters = {id(master): slot for master, slot in pairs}
        slots = [slot for _, slot in pairs]
        cuda = self.is_cuda
        out_ctx = torch.cuda.stream(self.out_stream) if cuda else contextlib.nullcontext()
        host_steps: list[torch.Tensor] = []
        groups = []
        for group, values in zip(twin.param_groups, hyper, strict=True):
            group.update(values)
            members = [(m, masters[id(m)]) for m in group["params"] if id(m) in masters]
            host_steps.extend(twin.state[m]["step"] for m, _ in members)
            groups.append((group, members))
        counts = torch.stack(host_steps)
        done = None
        if cuda:
            counts = counts.pin_memory()
            self.out_stream.wait_stream(torch.cuda.current_stream(self.manager.device))
            if loaded is not None:
                self.out_stream.wait_event(loaded)
        given = dict(zip((id(m) for m, _ in pairs), grads, strict=True)) if grads else None
        with out_ctx:
            if after is not None:
                after()
            steps = list(counts.to(flat.device, non_blocking=True).unbind())
            ordered: list[torch.Tensor] = []
            for _, members in groups:
                for master, slot in members:
                    grad = slot.param.grad if given is None else given[id(master)]
                    assert grad is not None
                    ordered.append(grad)
            _step_groups(twin, groups, offsets, (flat, scratch, 0), ordered, steps)
            host.copy_(flat, non_blocking=True)
            arena.copy_(scratch, non_blocking=True)
            if cuda:
                done = torch.cuda.Event()
                done.record()
                self.state_out[chunk.index] = done
                # The caching allocator keeps these until the out stream is past them.
                for tensor in (flat, scratch, *ordered, *keep):
                    tensor.record_stream(self.out_stream)
        torch._foreach_add_(host_steps, 1)
        self.updated_params += sum(s.numel for s in slots)
        self.updates += 1
        self.busy_s += time.perf_counter() - began
        future: Future = Future()
        if done is None:
            future.set_result(None)
        else:
            self.thread.submit(_complete_after, done, future)
        return future

    # ---- on the thread ---------------------------------------------------------------------------

    def _run(self, task: _Task, start: torch.cuda.Event | None) -> None:
        try:
            if task.after is not None:
                task.after.result()
            began = time.perf_counter()
            done = self._issue(task, start)
            self.busy_s += time.perf_counter() - began
        except BaseException as exc:  # surfaced where the chunk is next waited on
            task.future.set_exception(exc)
            self._complete_inflight()
            return
        self._complete_inflight()
        self._inflight = (task.future, done)

    def _flush(self) -> None:
        self._complete_inflight()
        self._set_free = [None, None]

    def _complete_inflight(self) -> None:
        if self._inflight is None:
            return
        future, event = self._inflight
        self._inflight = None
        try:
            if event is not None:
                event.synchronize()
        except BaseException as exc:
            future.set_exception(exc)
            return
        future.set_result(None)

    def _issue(self, task: _Task, start: torch.cuda.Event | None) -> torch.cuda.Event | None:
        """Issue ``task``'s copies in, update and copies out; the event after its copies out."""
        chunk, twin = task.chunk, task.twin
        arena = self.arenas[chunk.index]
        offsets = self.offsets[chunk.index]
        host = self.manager.host.view(chunk.index)
        scratch = task.scratch
        weights_end = _aligned(chunk.nbytes)
        grads_start, state_start = weights_end, 2 * weights_end
        steps_start = state_start + _aligned(arena.numel())
        cuda = self.is_cuda
        in_ctx = torch.cuda.stream(self.in_stream) if cuda else contextlib.nullcontext()
        out_ctx = torch.cuda.stream(self.out_stream) if cuda else contextlib.nullcontext()

        # Per twin group: the params with a gradient (torch's optimizers skip the others).
        groups = []
        host_grads, dev_grads, host_steps = [], [], []
        for group, values in zip(twin.param_groups, task.hyper, strict=True):
            group.update(values)
            members = []
            for master in group["params"]:
                if master.grad is None:
                    continue
                slot = self._slot(chunk, master)
                members.append((master, slot))
                host_grads.append(master.grad)
                view = scratch[grads_start + slot.offset : grads_start + slot.offset + slot.nbytes]
                dev_grads.append(view.view(slot.dtype).view(slot.shape))
                host_steps.append(twin.state[master]["step"])
            groups.append((group, members))
        if not host_grads:
            return None
        with in_ctx:
            if cuda:
                if start is not None:
                    self.in_stream.wait_event(start)
                free = self._set_free[task.slot % 2]
                if free is not None:
                    self.in_stream.wait_event(free)
            scratch[: chunk.nbytes].copy_(host, non_blocking=True)
            torch._foreach_copy_(dev_grads, host_grads, non_blocking=True)
            scratch[state_start : state_start + arena.numel()].copy_(arena, non_blocking=True)
            counts = torch.stack(host_steps)
            if cuda:
                counts = counts.pin_memory()
            steps_bytes = scratch[steps_start : steps_start + counts.numel() * 4]
            dev_counts = steps_bytes.view(torch.float32)
            dev_counts.copy_(counts, non_blocking=True)
            loaded = torch.cuda.Event() if cuda else None
            if loaded is not None:
                loaded.record()
        with out_ctx:
            if loaded is not None:
                self.out_stream.wait_event(loaded)
            if task.clip_coef != 1.0:
                torch._foreach_mul_(dev_grads, task.clip_coef)
            steps = list(dev_counts.unbind())
            _step_groups(twin, groups, offsets, (scratch, scratch, state_start), dev_grads, steps)
            host.copy_(scratch[: chunk.nbytes], non_blocking=True)
            arena.copy_(scratch[state_start : state_start + arena.numel()], non_blocking=True)
            done = torch.cuda.Event() if cuda else None
            if done is not None:
                done.record()
                self._set_free[task.slot % 2] = done
        torch._foreach_add_(host_steps, 1)
        self.updated_params += sum(g.numel() for g in host_grads)
        self.updates += 1
        return done

    def _slot(self, chunk: Chunk, master: torch.Tensor) -> ParamSlot:
        """The slot of ``chunk`` whose host bytes ``master`` is (masters are host views here)."""
        table = self.slots.get(chunk.index)
        if table is None:
            table = {
                self.manager.host_view(slot, chunk).data_ptr(): slot
                for slot in chunk.trainable_slots
            }
            self.slots[chunk.index] = table
        return table[master.data_ptr()]


def _step_groups(
    twin: torch.optim.Optimizer,
    groups: list[tuple[dict, list[tuple[torch.Tensor, ParamSlot]]]],
    offsets: dict[tuple[int, str], int],
    where: tuple[torch.Tensor, torch.Tensor, int],
    grads: list[torch.Tensor],
    steps: list[torch.Tensor],
) -> None:
    """``_adam`` over each twin group's members (its param and slot), in order: ``where`` is
    (the bytes holding the weights at their slot offsets, the bytes holding the state, the
    state's start in them: the arena's offsets count from it); ``grads`` and ``steps`` one
    per member, in the same order."""
    weights, state, state_start = where
    index = 0
    for group, members in groups:
        if not members:
            continue
        params, chunk_grads, states = [], [], {key: [] for key in state_keys(group)}
        for master, slot in members:
            params.append(_bytes_as(weights, slot.offset, slot))
            chunk_grads.append(grads[index])
            for key in states:
                at = state_start + offsets[(id(master), key)]
                states[key].append(_bytes_as(state, at, slot))
            index += 1
        _adam(twin, group, params, chunk_grads, states, steps[index - len(members) : index])


def _adam(
    twin: torch.optim.Optimizer,
    group: dict,
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: dict[str, list[torch.Tensor]],
    steps: list[torch.Tensor],
) -> None:
    """torch's fused Adam/AdamW over one twin group's tensors, with its hyperparameters."""
    beta1, beta2 = group["betas"]
    adam(
        params,
        grads,
        states["exp_avg"],
        states["exp_avg_sq"],
        states.get("max_exp_avg_sq", []),
        steps,
        foreach=False,
        capturable=False,
        differentiable=False,
        fused=True,
        grad_scale=None,
        found_inf=None,
        has_complex=False,
        decoupled_weight_decay=bool(
            group.get("decoupled_weight_decay", type(twin).__name__ == "AdamW")
        ),
        amsgrad=bool(group.get("amsgrad", False)),
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=bool(group.get("maximize", False)),
    )


def _bytes_as(flat: torch.Tensor, offset: int, slot: ParamSlot) -> torch.Tensor:
    """``slot``'s tensor over ``flat``'s bytes from ``offset``."""
    return flat[offset : offset + slot.nbytes].view(slot.dtype).view(slot.shape)


def _complete_after(event: torch.cuda.Event, future: Future) -> None:
    """On the thread: complete ``future`` once ``event`` is done (its error, if any, to it)."""
    try:
        event.synchronize()
    except BaseException as exc:
        future.set_exception(exc)
        return
    future.set_result(None)
