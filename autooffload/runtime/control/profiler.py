"""The step profiler: measures a live runtime's profiling step into a ``ModelProfile``.

It records per-block time and activation bytes, non-block memory and transient peaks on the
user's real first batch; ``plan/`` receives only the resulting ``ModelProfile``.

The first step runs under a conservative plan (no persistent chunks, every block
checkpointed) so it cannot run out of memory; its update is real. While it runs the runtime
reports group boundaries here; memory is read from the caching allocator at each boundary.
After the step, one block of each block class is re-run with its activations kept (the
*probe*, ``probe.py``) to measure what keeping costs and how long a block takes without copy
waits.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autooffload.errors import PlanError
from autooffload.plan.profile_types import ChunkProfile, ModelProfile, UnitProfile
from autooffload.runtime.control.probe import BlockProbe, Clock, grad_bytes

if TYPE_CHECKING:
    from autooffload.runtime.blocks import Group
    from autooffload.runtime.chunks.layout import Chunk
    from autooffload.runtime.runtime import Runtime


def _state_tensors(runtime: Runtime, chosen: Callable[[int], bool]) -> dict[tuple, torch.Tensor]:
    """The optimizers' state tensors of the params whose ``id`` is ``chosen``, by device and
    address (one tensor once)."""
    return {
        (value.device, value.data_ptr()): value
        for optimizer in runtime.optimizers
        for param, state in optimizer.state.items()
        if chosen(id(param))
        for value in state.values()
        if isinstance(value, torch.Tensor)
    }


def _persistent_extras(runtime: Runtime) -> int:
    """Device bytes of the gradients and optimizer state of persistent chunks' params now."""
    manager = runtime.manager
    params = {
        id(s.param): s.param
        for c in runtime.layout.chunks
        if c.index in manager.persistent
        for s in c.trainable_slots
    }
    grads = [p.grad for p in params.values() if p.grad is not None]
    tensors = {(g.device, g.data_ptr()): g for g in grads}
    tensors.update(_state_tensors(runtime, params.__contains__))
    return sum(t.nbytes for t in tensors.values() if t.device.type != "cpu")


def _unchunked_state_bytes(runtime: Runtime) -> int:
    """Device bytes of the optimizer state of trainable params in no chunk (LoRA adapters kept
    on the device), which the user's optimizer makes at its first step."""
    chunked = {id(s.param) for c in runtime.layout.chunks for s in c.trainable_slots}
    tensors = _state_tensors(runtime, lambda param: param not in chunked)
    return sum(t.nbytes for t in tensors.values() if t.device.type == runtime.device.type)


def block_kind(module: nn.Module) -> tuple:
    """What makes two blocks measure alike, so that one probe serves both: their class and
    their parameters' names, shapes and dtypes. T5's encoder and decoder blocks are one class,
    the decoder's with cross-attention; a ResNet's stages are one class at four widths."""
    return (
        type(module),
        tuple((name, tuple(p.shape), p.dtype) for name, p in module.named_parameters()),
    )


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


def block_input_bytes(module: nn.Module, args: tuple, kwargs: dict) -> int:
    """Bytes of a block call's first input (what a checkpointed block saves)."""
    return _tensor_bytes(primary_input(module, args, kwargs)[0][:1])


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
    """False for the first step (one-time costs make its times useless), True for the next;
    a first step longer than ``controller.MEASURE_FIRST_STEP_S`` is measured itself."""
    marks: list[_Mark] = field(default_factory=list)
    # Per block kind (``block_kind``): the first such block's group index and inputs.
    block_inputs: dict[tuple, tuple[int, tuple, dict]] = field(default_factory=dict)
    kinds: dict[int, tuple] = field(default_factory=dict)
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
        self.clock = Clock(self.runtime.device)
        # The measured step starts after a step: persistent chunks (a pinned n_persist, a
        # re-profile that keeps them) have their optimizer state and maybe their gradients on
        # the device, which the cost model counts apart (static_bytes excludes them as it
        # excludes their weights: 3.6B with 15 pinned counted 9 GB twice and found no plan).
        self.start_allocated = self.clock.allocated() - _persistent_extras(self.runtime)
        # A first profiling step measured itself (a long one) starts before the optimizer's
        # state exists: what the state of the params in no chunk takes, it adds at its step.
        self.start_unchunked_state = _unchunked_state_bytes(self.runtime)

    def elapsed_s(self) -> float:
        """Seconds since the step's first mark (the device's timeline on a GPU, waiting for it),
        0 before any mark."""
        if not self.marks:
            return 0.0
        return self.clock.seconds(self.marks[0].time, self.clock.mark())

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
            kind = self._kind(group)
            if kind not in self.block_inputs:
                detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
                self.block_inputs[kind] = (group.index, detached, dict(kwargs))
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

    def _kind(self, group: Group) -> tuple:
        if group.index not in self.kinds:
            self.kinds[group.index] = block_kind(group.module)
        return self.kinds[group.index]

    def _is_last_block(self, group: Group) -> bool:
        blocks = [g for g in self.runtime.groups if g.is_block]
        return (
            bool(blocks)
            and group.index == max(blocks, key=lambda g: self.runtime.position(g.index)).index
        )

    # ---- after the step -------------------------------------------------------------------

    def build(
        self, optim_bytes_per_param: int, micro_batches: int = 1, optim_step_bytes: int = 0
    ) -> ModelProfile:
        """The ``ModelProfile`` of this step (runs the probes); ``micro_batches`` the step's
        backward passes (gradient accumulation: the first micro-batch was measured)."""
        runtime = self.runtime
        probes: dict[tuple, UnitProfile] = {}
        # The probes run blocks in train mode (dropout): the user's RNG streams must not move.
        devices = [runtime.device] if runtime.device.type == "cuda" else []
        probe = BlockProbe(runtime, self.clock)
        with torch.random.fork_rng(devices=devices):
            for kind, (group_index, args, kwargs) in self.block_inputs.items():
                module = runtime.groups[group_index].module
                probes[kind] = probe.run(
                    module,
                    group_index,
                    args,
                    kwargs,
                    self.input_bytes.get(group_index, 0),
                    self._chunked_trainable,
                )
        order = sorted(runtime.groups, key=lambda g: runtime.position(g.index))
        block_groups = [g for g in order if g.is_block]
        unprofiled = [g for g in block_groups if self._kind(g) not in probes]
        if unprofiled:
            raise PlanError(
                f"autooffload: no {type(unprofiled[0].module).__name__} block (e.g."
                f" {unprofiled[0].name}) ran a forward with gradients enabled before the"
                " profiling step's backward, so its time and memory cannot be measured: its"
                " forward ran under torch.no_grad(), as torch.utils.checkpoint(...,"
                " use_reentrant=True) around blocks runs it (pass use_reentrant=False, or drop"
                " the call: autooffload checkpoints blocks itself), or it did not run in this"
                " step (profile on a batch that runs every block)"
            )
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
            probe = probes[self._kind(g)]
            # Each block of the kind takes its probe's times and sizes, its own input's bytes
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
            static_bytes=max(0, self.start_allocated - runtime.manager.resident_bytes())
            + max(0, _unchunked_state_bytes(runtime) - self.start_unchunked_state),
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
        return grad_bytes(self._chunked_trainable(params.values()))

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
