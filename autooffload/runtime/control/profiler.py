"""The step profiler: measures a live runtime's profiling step into a ``ModelProfile``.

It records per-block time and activation bytes, non-block memory and transient peaks on the
user's real first batch; ``plan/`` receives only the resulting ``ModelProfile``.

The first step runs under a conservative plan (no persistent chunks, every block
checkpointed) so it cannot run out of memory; its update is real. While it runs the runtime
reports group boundaries here; memory is read from the caching allocator at each boundary.
After the step, one block of each block class is re-run once with its activations kept (the
*probe*) to measure what keeping costs and how long a block takes without copy waits.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autooffload.plan.profile_types import ChunkProfile, ModelProfile, UnitProfile
from autooffload.runtime.activations import policies as activations
from autooffload.runtime.activations.tiled_mlp import find_mlp

if TYPE_CHECKING:
    from autooffload.runtime.blocks import Group
    from autooffload.runtime.chunks.layout import Chunk
    from autooffload.runtime.runtime import Runtime


PROBE_RUNS = 3


def _persistent_extras(runtime: Runtime) -> int:
    """Device bytes of the gradients and optimizer state of persistent chunks' params now."""
    manager = runtime.manager
    params = {
        id(s.param): s.param
        for c in runtime.layout.chunks
        if c.index in manager.persistent
        for s in c.trainable_slots
    }
    tensors: dict[int, torch.Tensor] = {}
    for param in params.values():
        if param.grad is not None:
            tensors[param.grad.data_ptr()] = param.grad
    for optimizer in runtime.optimizers:
        for param, state in optimizer.state.items():
            if id(param) in params:
                for value in state.values():
                    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                        tensors[value.data_ptr()] = value
    return sum(t.nbytes for t in tensors.values() if t.device.type != "cpu")


def _grad_bytes(params: Iterable[torch.Tensor]) -> int:
    """Bytes of the gradients of ``params`` (a gradient has its parameter's dtype and shape)."""
    return sum(p.numel() * p.element_size() for p in params)


def _tensor_bytes(values: Any) -> int:
    from torch.utils._pytree import tree_flatten

    seen: set[int] = set()
    total = 0
    for t in tree_flatten(values)[0]:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


@functools.cache
def _first_input_name(cls: type) -> str | None:
    """The name of the first parameter of ``cls.forward`` (the block's hidden states)."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.POSITIONAL_ONLY)
    named = [p for p in params[1:] if p.kind in kinds]
    return named[0].name if named else None


def primary_input(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of a block call with the block's first input positional: some blocks
    are called with keywords only (Llama-3.2-Vision's vision layers: ``hidden_state=``)."""
    if args:
        return args, kwargs
    name = _first_input_name(type(module))
    if name is None or not isinstance(kwargs.get(name), torch.Tensor):
        return args, kwargs
    rest = dict(kwargs)
    return (rest.pop(name),), rest


@contextlib.contextmanager
def _capture_input(mlp: nn.Module | None, inputs: list[torch.Tensor]) -> Iterator[None]:
    """Keep the first tensor input of ``mlp``'s latest call in ``inputs`` (detached)."""
    if mlp is None:
        yield
        return

    def hook(_module: nn.Module, args: tuple) -> None:
        if args and isinstance(args[0], torch.Tensor):
            inputs[:] = [args[0].detach()]

    handle = mlp.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


class _Clock:
    """Wall time on CPU; stream-ordered CUDA events on the GPU (copy waits excluded when the
    start is recorded after the stream waited for its chunks)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.cuda else 0

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else 0


# The marks kept from forwards before a step's first backward, per group: a model with
# nothing to train has its marks dropped past this (two per group per forward).
MARKS_PER_GROUP = 16


@dataclass
class _Mark:
    group: int
    phase: str
    allocated: int
    time: Any


@dataclass
class StepProfiler:
    """Collects boundary marks during the profiling step and builds the ``ModelProfile``."""

    runtime: Runtime
    warm: bool = False
    """False for the first step (one-time costs make its times useless), True for the next."""
    marks: list[_Mark] = field(default_factory=list)
    block_inputs: dict[type, tuple[int, tuple, dict]] = field(default_factory=dict)
    input_bytes: dict[int, int] = field(default_factory=dict)
    post_fwd_peak: int = 0
    post_bwd_peak: int = 0
    bwd_copied_start: int = 0
    post_bwd_copied: int = 0
    """Chunk bytes copied in between the backward's start and the last block's backward: the
    head's chunks fetched again (a profiling step does not keep them from the forward) and the
    prefetches behind them, which the cost model counts as chunks, not as the post transient."""
    backward_started: bool = False
    backwards: int = 0
    later_micro_batch: bool = False
    """A forward began after the step's first backward (gradient accumulation): the marks and
    peaks stay those of the first micro-batch, which the cost model's windows describe."""
    _chunked_ids: set[int] | None = None

    def __post_init__(self) -> None:
        self.clock = _Clock(self.runtime.device)
        # The measured step starts after a step: persistent chunks (a pinned n_persist, a
        # re-profile that keeps them) have their optimizer state and maybe their gradients on
        # the device, which the cost model counts apart (static_bytes excludes them as it
        # excludes their weights: 3.6B with 15 pinned counted 9 GB twice and found no plan).
        self.start_allocated = self.clock.allocated() - _persistent_extras(self.runtime)

    def _mark(self, group: Group, phase: str) -> None:
        self.marks.append(_Mark(group.index, phase, self.clock.allocated(), self.clock.mark()))

    def on_pre_forward(self, group: Group, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled():
            return  # an evaluation forward (no_grad, inference_mode): not the training step's
        if self.backward_started:
            self.later_micro_batch = True
        if self.later_micro_batch:
            return
        if len(self.marks) >= MARKS_PER_GROUP * len(self.runtime.groups) and not any(
            p.requires_grad for p in self.runtime.model.parameters()
        ):
            # Forwards with grad enabled of a model with nothing to train (a teacher run
            # outside no_grad): no backward or step will profile them; keep the marks bounded.
            self.marks.clear()
        if group.is_block:
            args, kwargs = primary_input(group.module, args, kwargs)
            self.input_bytes.setdefault(group.index, _tensor_bytes(args[:1]))
            cls = type(group.module)
            if cls not in self.block_inputs:
                detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
                self.block_inputs[cls] = (group.index, detached, dict(kwargs))
        self._mark(group, "fwd")

    def on_post_forward(self, group: Group) -> None:
        if not torch.is_grad_enabled() or self.later_micro_batch:
            return
        if group.is_block and self._is_last_block(group):
            self.clock.reset_peak()
        self._mark(group, "fwd_end")

    def on_pre_backward(self, group: Group) -> None:
        if self.later_micro_batch:
            return
        if not self.backward_started:
            self.backward_started = True
            self.backwards += 1
            self.post_fwd_peak = self.clock.peak()
            self.end_forward_allocated = self.clock.allocated()
            self.bwd_copied_start = self.runtime.manager.copied_in_bytes
            self.clock.reset_peak()
        if group.is_block and self._is_last_block(group) and not self.post_bwd_peak:
            self.post_bwd_peak = self.clock.peak()
            self.post_bwd_copied = self.runtime.manager.copied_in_bytes - self.bwd_copied_start
        self._mark(group, "bwd")

    def _is_last_block(self, group: Group) -> bool:
        blocks = [g for g in self.runtime.groups if g.is_block]
        return (
            bool(blocks)
            and group.index == max(blocks, key=lambda g: self.runtime.position(g.index)).index
        )

    # ---- after the step -------------------------------------------------------------------

    def _probe(self, block: nn.Module, group_index: int, args: tuple, kwargs: dict) -> UnitProfile:
        """Run one block on its own: saved bytes, transients, forward and backward times. The
        block runs through its ``__call__`` (the hooks of HF and others with it; the runtime's
        own step aside), as in the step: where the launching thread is the bottleneck (a small
        block at a short batch), the call path is part of the time."""
        runtime = self.runtime
        policy = activations.policy_of(block)
        activations.remove_policy(block)
        chunks = runtime.layout.chunks_of_group[group_index]
        for index in chunks:
            runtime.manager.gather(index)
        params = [p for p in block.parameters() if p.requires_grad]
        # A KV cache the step's forward wrote to would be appended to again by every run.
        kwargs = {k: v for k, v in kwargs.items() if not activations.is_kv_cache(k, v)}
        if "use_cache" in kwargs:
            kwargs["use_cache"] = False
        saved = [0]
        mlp = find_mlp(block)
        mlp_inputs: list[torch.Tensor] = []
        mlp_fields: dict[str, Any] = {}
        try:
            with runtime.step_state.probe():
                # The first run pays one-time costs (allocator growth, kernel selection); the
                # timings are the best of PROBE_RUNS, the memory figures those of the last run.
                best = (float("inf"), float("inf"))
                for _ in range(PROBE_RUNS):
                    saved[0] = 0
                    with _capture_input(mlp, mlp_inputs):
                        measured = self._probe_once(
                            block, self._inputs(args), kwargs, params, saved
                        )
                    fwd_s, bwd_s, kept, fwd_peak, bwd_peak = measured
                    best = (min(best[0], fwd_s), min(best[1], bwd_s))
                fwd_s, bwd_s = best
                if mlp is not None and mlp_inputs:
                    mlp_fields = self._probe_mlp(mlp, mlp_inputs[-1])
        finally:
            for index in chunks:
                runtime.manager.release(index)
            if policy != "keep":
                runtime.apply_block_policy(block, policy)
        # The probe's backward allocates the block's parameter gradients; the cost model adds
        # them (offloaded and persistent grads per unit), so they leave the transient, which
        # may go negative (down to -kept: activations are freed as the gradients are made).
        bwd_transient = max(0, bwd_peak)
        if self.clock.cuda:
            bwd_transient = max(-int(kept), bwd_peak - _grad_bytes(self._chunked_trainable(params)))
        return UnitProfile(
            fwd_s=fwd_s,
            bwd_s=bwd_s,
            act_bytes_keep=int(kept),
            act_bytes_checkpoint=self.input_bytes.get(group_index, 0),
            fwd_transient_bytes=int(max(0, fwd_peak - kept)),
            bwd_transient_bytes=int(bwd_transient),
            name=type(block).__name__,
            **mlp_fields,
        )

    def _probe_mlp(self, mlp: nn.Module, x: torch.Tensor) -> dict[str, Any]:
        """Run a block's MLP on its own, on the input it had in the block: the bytes it saves
        beyond that input, its own transients and its forward time (``UnitProfile.mlp_*``)."""
        params = [p for p in mlp.parameters() if p.requires_grad]
        saved = [0]
        best_s = float("inf")
        for _ in range(2):
            saved[0] = 0
            inputs = self._inputs((x,))
            fwd_s, _, kept, fwd_peak, bwd_peak = self._probe_once(
                mlp, inputs, {}, params, saved, skip=inputs[0]
            )
            best_s = min(best_s, fwd_s)
        bwd_transient = max(0, bwd_peak)
        if self.clock.cuda:
            bwd_transient = max(-int(kept), bwd_peak - _grad_bytes(self._chunked_trainable(params)))
        return {
            "mlp_act_bytes": int(kept),
            "mlp_fwd_transient_bytes": int(max(0, fwd_peak - kept)),
            "mlp_bwd_transient_bytes": int(bwd_transient),
            "mlp_fwd_s": best_s,
        }

    @staticmethod
    def _inputs(args: tuple) -> tuple:
        """``args`` with the first input a fresh leaf that takes a gradient (as a block's input
        does in the step), so each run's backward reaches it."""
        if args and isinstance(args[0], torch.Tensor):
            x = args[0].detach().requires_grad_(args[0].is_floating_point())
            return (x, *args[1:])
        return args

    def _probe_once(
        self,
        block: nn.Module,
        inputs: tuple,
        kwargs: dict,
        params: list,
        saved: list[int],
        skip: torch.Tensor | None = None,
    ) -> tuple[float, float, int, int, int]:
        """One forward and backward of ``block``: (fwd_s, bwd_s, kept, fwd_peak, bwd_peak).
        ``saved`` counts the bytes autograd saves (CPU only: the GPU reads the allocator),
        those of ``skip``'s storage aside."""
        x = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
        skipped = skip.untyped_storage().data_ptr() if skip is not None else None

        def pack(t: torch.Tensor) -> torch.Tensor:
            if not isinstance(t, nn.Parameter) and (
                skipped is None or t.untyped_storage().data_ptr() != skipped
            ):
                saved[0] += t.numel() * t.element_size()
            return t

        # On the GPU the allocator gives the saved bytes, and a Python hook per saved tensor
        # would add host time the step does not have.
        counting = (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            if not self.clock.cuda
            else contextlib.nullcontext()
        )
        base = self.clock.allocated()
        self.clock.reset_peak()
        start = self.clock.mark()
        with torch.enable_grad(), counting:
            out = block(*inputs, **kwargs)
        end = self.clock.mark()
        outs = out if isinstance(out, tuple) else (out,)
        first = outs[0]
        if self.clock.cuda:
            kept = self.clock.allocated() - base - first.numel() * first.element_size()
        else:
            kept = saved[0]
        fwd_peak = self.clock.peak() - base
        grad_inputs = [x] + params if x is not None and x.requires_grad else params
        self.clock.reset_peak()
        before_bwd = self.clock.allocated()
        bstart = self.clock.mark()
        if grad_inputs and first.requires_grad:
            torch.autograd.grad(first, grad_inputs, torch.ones_like(first))
        bend = self.clock.mark()
        bwd_peak = self.clock.peak() - before_bwd
        fwd_s = self.clock.seconds(start, end)
        bwd_s = self.clock.seconds(bstart, bend)
        return fwd_s, bwd_s, int(kept), int(fwd_peak), int(bwd_peak)

    def build(
        self, optim_bytes_per_param: int, micro_batches: int = 1, optim_step_bytes: int = 0
    ) -> ModelProfile:
        """The ``ModelProfile`` of this step (runs the probes); ``micro_batches`` the step's
        backward passes (gradient accumulation: the first micro-batch was measured)."""
        runtime = self.runtime
        probes: dict[type, UnitProfile] = {}
        # The probes run blocks in train mode (dropout): the user's RNG streams must not move.
        devices = [runtime.device] if runtime.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            for cls, (group_index, args, kwargs) in self.block_inputs.items():
                module = runtime.groups[group_index].module
                probes[cls] = self._probe(module, group_index, args, kwargs)
        order = sorted(runtime.groups, key=lambda g: runtime.position(g.index))
        block_groups = [g for g in order if g.is_block]
        unit_of: dict[int, int] = {}
        unit = 0
        for g in order:
            if g.is_block:
                unit = block_groups.index(g) + 1
            elif block_groups and runtime.position(g.index) > runtime.position(
                block_groups[-1].index
            ):
                unit = len(block_groups) + 1
            unit_of[g.index] = unit
        blocks = []
        for g in block_groups:
            probe = probes[type(g.module)]
            # Each block of the class takes its probe's times and sizes, its own input's bytes
            # and its own name.
            blocks.append(
                replace(
                    probe,
                    act_bytes_checkpoint=self.input_bytes.get(g.index, probe.act_bytes_checkpoint),
                    name=g.name,
                )
            )
        pre, post = self._edge_units(block_groups)
        # Tokens per step: those of the block class that ran last (a VLM's decoder, not its
        # vision tower's patches).
        tokens = 1
        firsts = [a[0] for _, a, _ in self.block_inputs.values() if a]
        if firsts and isinstance(firsts[-1], torch.Tensor):
            tokens = max(1, firsts[-1].shape[:-1].numel())
        chunk_profiles = tuple(
            self._chunk_profile(runtime, c, tuple(sorted({unit_of[g] for g in c.groups})), tokens)
            for c in runtime.layout.chunks
        )
        return ModelProfile(
            chunk_size=runtime.layout.chunk_size,
            chunks=chunk_profiles,
            blocks=tuple(blocks),
            pre=pre,
            post=post,
            batch_tokens=tokens,
            static_bytes=max(0, self.start_allocated - runtime.manager.resident_bytes()),
            optim_bytes_per_param=optim_bytes_per_param,
            optim_step_bytes_per_param=optim_step_bytes,
            weight_dtype=str(runtime.weight_dtype()).replace("torch.", ""),
            grad_accumulation=micro_batches > 1,
            micro_batches=max(1, micro_batches),
            update_in_backward=runtime.backward_update.on,
            persistent_at_step=runtime.data_parallel is not None,
            expandable_segments=runtime.expandable_segments,
        )

    def _post_bwd_transient(self, end_alloc: int, post_act: int, last_block: Group) -> int:
        """The post unit's backward peak above its kept bytes, less what the cost model counts
        apart: the head's gradients (at 3.6B the untied head's 0.79 GB gradient was counted
        twice, +5.3% on the peak) and the chunks copied in. It may be negative, down to
        ``-post_act``: the loss's temporaries are freed before the head's gradient is made."""
        if not self.clock.cuda or not self.post_bwd_peak:
            return max(0, self.post_bwd_peak - end_alloc)
        apart = self._post_grad_bytes(last_block) + self.post_bwd_copied
        return max(-post_act, self.post_bwd_peak - end_alloc - apart)

    def _post_grad_bytes(self, last_block: Group) -> int:
        """Gradient bytes of the trainable parameters of the groups after ``last_block`` (the
        final norm and the head): their backward runs, and allocates them, in the post window."""
        runtime = self.runtime
        last = runtime.position(last_block.index)
        params = {
            id(p): p
            for g in runtime.groups
            if not g.is_block and runtime.position(g.index) > last
            for _, p in g.params()
        }
        return _grad_bytes(self._chunked_trainable(params.values()))

    def _chunked_trainable(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """Those of ``params`` whose gradients the cost model counts: trainable and in a chunk
        (resident ones, such as LoRA adapters kept on the device, are not in the chunk tables)."""
        if self._chunked_ids is None:
            self._chunked_ids = {
                id(s.param) for c in self.runtime.layout.chunks for s in c.trainable_slots
            }
        return [p for p in params if id(p) in self._chunked_ids]

    @staticmethod
    def _chunk_profile(
        runtime: Runtime, chunk: Chunk, units: tuple[int, ...], tokens: int
    ) -> ChunkProfile:
        """One chunk as the profiled step ran it (served from the host or not)."""
        profile = ChunkProfile(
            bytes=chunk.nbytes,
            trainable_bytes=chunk.trainable_bytes,
            trainable_numel=sum(s.numel for s in chunk.trainable_slots),
            units=units,
            backward=not set(chunk.groups) <= runtime.hooks.backward_free,
        )
        if chunk.index not in runtime.host_vocab.served:
            return profile
        served = runtime.host_vocab.servable[chunk.index].bytes_for(tokens)
        return replace(
            profile,
            served=True,
            served_fwd_bytes=served.fwd,
            served_bwd_bytes=served.bwd,
            served_device_bytes=served.device,
        )

    def _edge_units(self, block_groups: list[Group]) -> tuple[UnitProfile, UnitProfile]:
        fwd = [m for m in self.marks if m.phase in ("fwd", "fwd_end")]
        if not fwd or not block_groups:
            empty = UnitProfile(0.0, 0.0, 0)
            return empty, empty
        first_block = block_groups[0].index
        last_block = block_groups[-1].index
        start = fwd[0]
        first_block_mark = next(m for m in fwd if m.group == first_block and m.phase == "fwd")
        last_end = [m for m in fwd if m.group == last_block and m.phase == "fwd_end"][-1]
        first_input = self.input_bytes.get(first_block, 0)
        pre_act = max(0, first_block_mark.allocated - start.allocated - first_input)
        end_alloc = getattr(self, "end_forward_allocated", last_end.allocated)
        post_act = max(0, end_alloc - last_end.allocated)
        pre_s = self.clock.seconds(start.time, first_block_mark.time)
        bwd_marks = [m for m in self.marks if m.phase == "bwd"]
        post_bwd_s = 0.0
        if bwd_marks:
            last_block_bwd = [m for m in bwd_marks if m.group == last_block]
            if last_block_bwd:
                post_bwd_s = self.clock.seconds(bwd_marks[0].time, last_block_bwd[0].time)
        post_fwd_s = 0.0
        if bwd_marks:
            post_fwd_s = self.clock.seconds(last_end.time, bwd_marks[0].time)
        pre = UnitProfile(pre_s, pre_s, pre_act, name="pre")
        post = UnitProfile(
            fwd_s=post_fwd_s,
            bwd_s=post_bwd_s,
            act_bytes_keep=post_act,
            fwd_transient_bytes=max(0, self.post_fwd_peak - end_alloc),
            bwd_transient_bytes=self._post_bwd_transient(end_alloc, post_act, block_groups[-1]),
            name="post",
        )
        return pre, post
