"""The module hooks that move chunks as a step runs: gather before a group's forward, prefetch
the next groups', release after it; in the backward, offload finished gradients, release, gather
and prefetch in reverse order (``StepHooks``, one per ``Runtime``).

The forward's group order (the trace) drives the backward: a chunk is released once every group
using it lies later in the trace than the group whose backward starts. Two refinements spare
copies that nothing could overlap: the post part's chunks (after the last block: final norm and
head) stay on the device from their forward into the backward that starts with them, and a group
that no backward runs through (no output has a ``grad_fn`` and nothing in it trains, as a frozen
embedding under LoRA) is neither gathered nor prefetched in the backward. The first is for
searched plans only, whose post unit counts its chunks beside the loss's transients; the
profiling steps release them as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from autooffload.errors import AutoOffloadError, UnsupportedAutogradError
from autooffload.log import logger, warn_once
from autooffload.runtime.attachable import check_params_after_attach
from autooffload.runtime.blocks import Group
from autooffload.runtime.chunks.store import Residency
from autooffload.runtime.control.profiler import block_input_bytes
from autooffload.runtime.parallel.lockstep import (
    BACKWARD,
    BACKWARD_END,
    FORWARD_NO_GRAD,
    FORWARD_WITH_GRAD,
)

if TYPE_CHECKING:
    from autooffload.runtime.chunks.layout import ChunkLayout
    from autooffload.runtime.runtime import Runtime


def in_backward() -> bool:
    """Whether an autograd backward is running on this thread (recomputes included)."""
    return torch._C._current_graph_task_id() != -1


def reduce_order(layout: ChunkLayout, positions: dict[int, int]) -> list[int]:
    """The chunks with trainable params in the order a backward completes them under the
    forward order ``positions`` (group -> position): by their earliest user, latest first;
    chunks with a group that did not run there come last (as ``_pre_backward`` never finds
    them complete, they complete at the end of a backward)."""

    def earliest(index: int) -> int:
        return min(positions.get(g, -1) for g in layout.chunks[index].groups)

    trainable = [c.index for c in layout.chunks if c.trainable_slots]
    return sorted(trainable, key=lambda index: (-earliest(index), -index))


class StepHooks:
    """The forward and backward hooks of one runtime's groups: they gather, prefetch and
    release chunks as a step runs and send finished gradients out; the trace of the group order
    they follow is their own state. Installed in one place (``install``), removed by
    ``remove``."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        # The runtime's parts the hooks drive (fixed for the runtime's life).
        self.model = runtime.model
        self.groups = runtime.groups
        self.layout = runtime.layout
        self.manager = runtime.manager
        self.cpu_optim = runtime.cpu_optim
        self.control = runtime.control
        self.data_parallel = runtime.data_parallel
        self.settings = runtime.settings
        self.device = runtime.device
        self.step_state = runtime.step_state
        self.host_vocab = runtime.host_vocab
        self.activations = runtime.activations
        self._handles: list[RemovableHandle] = []
        self._trace: list[int] = []
        # Groups whose forward is running now (nested modules owning params), innermost last.
        self._active: list[int] = []
        # Groups whose forward ran other groups' (an encoder owning params around its layers).
        self._enclosing: set[int] = set()
        self._last_trace: list[int] = [g.index for g in self.groups]
        self._position = {g: i for i, g in enumerate(self._last_trace)}
        # Groups after the last block (final norm, head): their chunks stay on the device from
        # their forward into the backward, which starts with them (``_kept`` until it does).
        self._post_groups = self._after_last_block(self._last_trace)
        self._kept: set[int] = set()
        # Groups whose backward reads no weights: no backward gather, no backward prefetch.
        self.backward_free: set[int] = set()

    @property
    def last_trace(self) -> list[int]:
        """Group indices in the order the last complete forward ran them (the attach order
        until one has run)."""
        return list(self._last_trace)

    def position(self, group_index: int) -> int:
        """Where group ``group_index`` ran in the last complete forward."""
        return self._position.get(group_index, len(self._position) + group_index)

    def install(self) -> None:
        """Register the hooks on the model and its groups."""
        # Around the whole model: registered first and last so they run before and after the
        # groups' hooks (the root module may be a group itself).
        self._handles.append(self.model.register_forward_pre_hook(self._begin_forward))
        for group in self.groups:
            module = group.module
            self._handles.append(
                module.register_forward_pre_hook(
                    lambda m, a, k, g=group: self._pre_forward(g, a, k), with_kwargs=True
                )
            )
            self._handles.append(
                module.register_forward_hook(
                    lambda m, a, out, g=group: self._post_forward(g, out), always_call=True
                )
            )
        self._handles.append(self.model.register_forward_hook(self._end_forward, always_call=True))

    def remove(self) -> None:
        """Remove every hook ``install`` registered, and forget the runtime (at detach)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        # A cycle through the runtime otherwise, keeping a dropped model alive until a cyclic gc.
        del self.runtime

    def hook_ids(self) -> set[int]:
        """The ids of the module hooks installed on the model (their handles' ``id``)."""
        return {handle.id for handle in self._handles}

    def drop_partial_trace(self) -> None:
        """A failed forward's group order is partial: the next backward must not follow it."""
        self._trace = []

    def drop_active_groups(self) -> None:
        """No group's forward is running any more (a failed pass unwound them)."""
        self._active.clear()

    def resume_group(self, group: Group, args: tuple, kwargs: dict) -> None:
        """Run ``group``'s forward pre-hook again (a forward re-run after the hook ran)."""
        self._pre_forward(group, args, kwargs)

    def _begin_forward(self, module: nn.Module, args: tuple) -> None:
        if in_backward():
            return
        if self.manager.sharding is not None:
            phase = FORWARD_WITH_GRAD if torch.is_grad_enabled() else FORWARD_NO_GRAD
            self.manager.sharding.check_in_step(phase, self.manager.persistent)
        self.recover_interrupted()
        if torch.is_grad_enabled():
            check_params_after_attach(self.runtime)
            self.activations.take_over_late_hf_checkpointing()
            if self.step_state.backwards_this_step:
                # Gradient accumulation: the next micro-batch.
                self.cpu_optim.staging.release_staging()

    def _end_forward(self, module: nn.Module, args: tuple, output: object) -> None:
        if in_backward():
            return
        if output is None:
            # An exception is on its way out of the model (always_call): this trace is partial.
            self._trace = []
            self._kept.clear()
        else:
            # The forward's group order drives this backward's releases and prefetches.
            self._trace_end()
        self.recover_interrupted(keep=self._kept)

    def recover_interrupted(self, keep: set[int] | frozenset[int] = frozenset()) -> None:
        """Clean up after a forward or backward that an exception or Ctrl-C cut short.

        Runs before each forward of the whole model and each optimizer step; does nothing
        after a complete step. A backward that never reached its end callback left offloaded
        gradients on the device and chunks resident: the gradients go to the host (plain torch
        keeps such partial gradients in ``.grad`` too; ``zero_grad`` clears both), and every
        non-persistent chunk is released, so no stale copy outlives the next CPU update. The
        post part's chunks kept for a backward that never came are released alone (no recovery:
        nothing was interrupted); ``keep``: chunks to leave (at the end of a forward, those kept
        for its backward).
        """
        if self._kept and not keep:
            # Kept for a backward that never came (a forward under grad, then none): nothing
            # was interrupted, so only they go; pending gradient reductions are left alone.
            for index in self._kept:
                self.manager.release(index)
            self._kept.clear()
        stale_backward = self.step_state.interrupted_backward(running=in_backward())
        persistent = self.manager.persistent
        stray = any(
            state != Residency.HOST and index not in persistent and index not in keep
            for index, state in enumerate(self.manager.state)
        )
        if not stale_backward and not stray:
            return
        self._kept.clear()
        if self.manager.is_cuda:
            # No copy may still be writing memory that the clean-up below frees (and an OOM
            # retry's empty_cache unmaps); an interruption is rare, the wait is cheap.
            torch.cuda.synchronize(self.device)
        if stale_backward:
            logger.debug("a backward pass was interrupted; offloading its partial gradients")
            for index in range(len(self.layout.chunks)):
                self.manager.grads.offload_grads(index)
            self.step_state.abandon_backward()
            self._trace = []
        self._active.clear()
        self.manager.release_all()
        self.cpu_optim.gpu.drop_loaded()
        if self.activations.swapper is not None:
            self.activations.swapper.forget()
        if self.data_parallel is not None:
            self.data_parallel.discard()

    def offload_assigned_grads(self) -> None:
        """Send to the host the gradients user code assigned to offloaded params' ``.grad``
        outside a backward (``p.grad = g`` with ``g`` from ``torch.autograd.grad``): the CPU
        update reads host gradients only, and the user's optimizer would step the params'
        released storage. Every backward sends its own before it ends."""
        if in_backward():
            return
        for chunk in self.layout.chunks:
            if chunk.index in self.manager.persistent:
                continue
            if not any(slot.param.grad is not None for slot in chunk.trainable_slots):
                continue
            if self.data_parallel is not None:
                raise UnsupportedAutogradError(
                    "autooffload: an offloaded param's .grad was assigned outside a backward"
                    " under data parallelism, where gradients are averaged across ranks in"
                    " the backward; compute it with loss.backward() instead"
                )
            self.manager.grads.offload_grads(chunk.index)

    def _chunks(self, group: Group) -> list[int]:
        served = self.host_vocab.served
        return [i for i in self.layout.chunks_of_group[group.index] if i not in served]

    def _pre_forward(self, group: Group, args: tuple = (), kwargs: dict | None = None) -> None:
        if self.step_state.hooks_muted:
            return
        if in_backward():
            self._ensure_end_callback()
            for index in self._chunks(group):
                self.manager.gather(index)
            return
        if self._trace and group.index == self._last_trace[0] and group.index in self._trace:
            # Forwards that bypass the root module: the last trace's first group comes round
            # again. (Not merely that group: the static first group is not the first to run in
            # every model; Qwen2-VL embeds tokens before its vision tower, and ending the trace
            # there left one group in it, so no chunk was ever released in a backward.)
            self._trace_end()
        self.cpu_optim.early.check_no_early_read("a forward of the attached model")
        self.control.before_forward()
        self._trace.append(group.index)
        self._enclosing.update(self._active)
        self._active.append(group.index)
        for index in self._chunks(group):
            self.manager.gather(index)
        self._prefetch_after(group.index, forward=True)
        if self.control.profiler is not None:
            if group.is_block and torch.is_grad_enabled():
                x = block_input_bytes(group.module, args, kwargs or {})
                self.activations.fit_long_batch_for_profiling(x, self.control.plan.budget_bytes)
            self.control.profiler.on_pre_forward(group, args, kwargs or {})

    def _post_forward(self, group: Group, output: object) -> None:
        if self.step_state.hooks_muted or in_backward():
            return
        backward = False
        if torch.is_grad_enabled():
            backward = self._register_backward(group, output)
            if backward:
                self.backward_free.discard(group.index)
            else:
                self.backward_free.add(group.index)
        if self.control.profiler is not None:
            self.control.profiler.on_post_forward(group)
        swapper = self.activations.swapper
        if swapper is not None and group.is_block and group.block_index is not None:
            # A swapped block's device tensors go at the end of the next block's forward, as
            # the cost model has it (``in_flight``), whatever that block's policy: the last
            # swapped block's stayed until the backward (3.6B @ 16 GiB with blocks 0-15
            # swapped: ~0.6 GiB live through 12 checkpointed blocks and the loss, and the
            # allocated peak 9% over its prediction).
            swapper.release_in_flight(before=group.block_index)
        if group.index in self._active:
            del self._active[len(self._active) - 1 - self._active[::-1].index(group.index)]
        position = self._position.get(group.index, len(self._position))
        for index in self._chunks(group):
            users = self.layout.chunks[index].groups
            later = any(self._position.get(user, -1) > position for user in users)
            # A group whose forward encloses this one (a module owning params that calls
            # other param-owning modules) still needs the chunks they share.
            enclosing = any(user in self._active for user in users)
            if later or enclosing:
                continue
            # Not in profiling steps: their plan is not costed, and the loss's transients
            # (logits, an fp32 upcast) come on top of the kept chunks (8B QLoRA at 5 GiB ran
            # out of memory there with a 1 GiB head kept).
            if backward and group.index in self._post_groups and not self.control.profiling:
                self._kept.add(index)
            else:
                self.manager.release(index)

    def _register_backward(self, group: Group, output: object) -> bool:
        """Hook ``_pre_backward`` on the group's outputs if its backward reads its weights: some
        output has a ``grad_fn``, or a param of the module trains. An output made to require
        grad after the fact (PEFT's ``enable_input_require_grads`` on a frozen embedding) is a
        leaf: no backward runs through the group, and its chunks are not fetched for one."""
        tensors = [
            t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if not tensors:
            return False
        if not any(t.grad_fn is not None for t in tensors) and not any(
            p.requires_grad for p in group.module.parameters()
        ):
            return False
        torch.autograd.graph.register_multi_grad_hook(
            tensors, lambda grads, g=group: self._pre_backward(g), mode="any"
        )
        return True

    def _prefetch_after(self, group_index: int, forward: bool) -> None:
        order = self._last_trace if forward else list(reversed(self._last_trace))
        try:
            start = order.index(group_index) + 1
        except ValueError:
            return
        for next_group in order[start:]:
            if not forward and next_group in self.backward_free:
                continue
            chunks = [
                i
                for i in self.layout.chunks_of_group[next_group]
                if i not in self.host_vocab.served
            ]
            # Backward takes a group's chunks last-first, the order the planner models
            # (plan/residency.prefetch_queue) when a buffer limit cuts a group's chunks.
            for index in chunks if forward else reversed(chunks):
                if (
                    self.manager.state[index] == Residency.HOST
                    and index not in self.manager.persistent
                ):
                    if not self.manager.prefetch(index):
                        return

    def _pre_backward(self, group: Group) -> None:
        if torch.is_grad_enabled():
            # Autograd runs a backward under grad mode exactly when it builds a graph of it.
            # That graph saves the offloaded weights, which are released once this backward
            # ends, and no hook brings them back for its own backward.
            raise UnsupportedAutogradError(
                f"autooffload: a backward with create_graph=True (a double backward, such as"
                f" a gradient penalty) reached {group.name} of an attached model, whose"
                " offloaded weights cannot be differentiated twice; compute the loss without"
                " create_graph=True, or train this model without offloading"
                " (AUTOOFFLOAD_OFFLOAD=0)"
            )
        self._ensure_end_callback()
        if self.data_parallel is not None:
            self._check_not_averaged_yet(group)
        if group.index in self._enclosing:
            # Its backward starts before those of the groups its forward ran, which come later
            # in the trace: nothing is complete yet. Its own chunks complete as any earlier
            # group's do, at the backward of the group before it.
            for index in self._chunks(group):
                self.manager.gather(index)
            return
        position = self._position.get(group.index, 0)
        # Highest index first, as ``reduce_order`` breaks ties (chunks of one group complete
        # together): a lower one handled first would wait for the higher one's reduction and
        # be released before it ran, its weights gone for a device update behind it.
        for index in reversed(range(len(self.manager.state))):
            state = self.manager.state[index]
            if state == Residency.HOST or index in self.manager.persistent:
                continue
            users = self.layout.chunks[index].groups
            if all(self._position.get(u, -1) > position for u in users):
                self._chunk_backward_done(index)
        if self.data_parallel is not None or self.cpu_optim.in_backward.persistent_armed:
            # Persistent chunks whose backward is complete start their gradient average now,
            # or are stepped now, their gradients dropped (runtime/update/persistent_update.py).
            for index in self.manager.persistent:
                users = self.layout.chunks[index].groups
                if not all(self._position.get(u, -1) > position for u in users):
                    continue
                if self.data_parallel is not None:
                    self.manager.grads.offload_grads(index)
                else:
                    self.cpu_optim.in_backward.update_persistent(self.layout.chunks[index])
        # The profiler's mark comes before this group's gathers: a window's memory then starts
        # without the chunks it fetches, which the profiler tells apart (``copied_in_bytes``).
        if self.control.profiler is not None:
            self.control.profiler.on_pre_backward(group)
        for index in self._chunks(group):
            self.manager.gather(index)
        updates = self.cpu_optim.in_backward
        if updates.gpu_chunks and updates.armed:
            # The state of the chunks the GPU updates in the backward comes in one group
            # ahead of their backward (plan/update_split.py: the window before theirs).
            for index in updates.gpu_chunks:
                users = self.layout.chunks[index].groups
                if max(self._position.get(u, -1) for u in users) >= position - 1:
                    updates.load_state(self.layout.chunks[index])
        if self.activations.swapper is not None and group.is_block:
            order = [g.index for g in self.activations.blocks_in_order()]
            if group.index in order and order.index(group.index) > 0:
                self.activations.swapper.prefetch(order.index(group.index) - 1)
        self._prefetch_after(group.index, forward=False)

    def _chunk_backward_done(self, index: int) -> None:
        """Offloaded chunk ``index``'s backward is complete: the GPU updates it now (under the
        update in the backward, the chunks the plan gives it), or its gradients go to the
        host; then its buffer is released."""
        if not self.cpu_optim.in_backward.update_on_device(self.layout.chunks[index]):
            self.manager.grads.offload_grads(index)
        self.manager.release(index)

    def _check_not_averaged_yet(self, group: Group) -> None:
        """Raise if ``group``'s backward comes after its trainable weights' gradients were
        averaged across ranks: what it adds would stay on this rank (offloaded params: read by
        the optimizer from freed storage). A module run from another's forward hook, after
        that one's forward, has its backward after that one's, where the chunks it shares
        with later modules are complete. One GPU needs no check: the end of the backward
        sends such late gradients on."""
        late = [i for i in self._chunks(group) if self.manager.grads.reduced_in_this_backward(i)]
        if not late:
            return
        mine = {id(p) for _, p in group.params() if p.requires_grad}
        slots = (s for i in late for s in self.layout.chunks[i].trainable_slots)
        if any(id(s.param) in mine for s in slots):
            raise AutoOffloadError(
                f"autooffload: the backward of {group.name} came after its gradients were"
                " averaged across ranks, because it runs after the forward of the module"
                " before it (a forward hook calls it?); under data parallelism call it from"
                " a forward pre-hook of the module after it, or from the model's forward"
            )

    def _ensure_end_callback(self) -> None:
        task = torch._C._current_graph_task_id()
        if self.step_state.is_new_backward(task):
            if self.manager.sharding is not None:
                self.manager.sharding.check_in_step(BACKWARD, self.manager.persistent)
            backward_id = self.step_state.begin_backward(task)
            if not self.step_state.cleared_since_step:
                warn_once(
                    "backward-without-zero-grad",
                    "autooffload: a backward after optimizer.step() with no zero_grad() since:"
                    " offloaded params' gradients (kept on the host, not in .grad) accumulate"
                    " across steps; clear them with optimizer.zero_grad() or model.zero_grad(),"
                    " not by setting p.grad = None",
                )
            self._kept.clear()  # this backward takes them over
            self.manager.grads.begin_backward(backward_id)
            if self.cpu_optim.in_backward.persistent_armed:
                persistent = [self.layout.chunks[i] for i in sorted(self.manager.persistent)]
                self.cpu_optim.in_backward.begin_backward(persistent)
            if self.data_parallel is not None and self.manager.grads.reduce_order is None:
                # Rank 0's forward order fixes every rank's reduction order (collectives must
                # pair up even where a module ran on one rank only).
                positions = self.data_parallel.agree_object(dict(self._position))
                self.manager.grads.set_reduce_order(reduce_order(self.layout, positions))
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        for index in reversed(range(len(self.layout.chunks))):  # as in ``_pre_backward``
            if index in self.manager.persistent:
                self.manager.grads.offload_grads(index)
            else:
                self._chunk_backward_done(index)
        self.cpu_optim.gpu.drop_loaded()
        if self.data_parallel is None and self.cpu_optim.in_backward.persistent_armed:
            for index in sorted(self.manager.persistent):
                self.cpu_optim.in_backward.update_persistent(self.layout.chunks[index])
        self.manager.grads.flush_reductions()
        if self.data_parallel is not None:
            # Every trainable param outside chunks: resident ones and any PEFT added later.
            owns = self.runtime.owns
            unchunked = [p for p in self.model.parameters() if p.grad is not None and not owns(p)]
            self.data_parallel.end_backward(unchunked)
            self.manager.grads.drop_grads_unused_everywhere()
        if self.manager.sharding is not None:
            self.manager.sharding.check_in_step(BACKWARD_END, self.manager.persistent)
        self.step_state.end_backward()
        self._trace_end()

    def _trace_end(self) -> None:
        """A forward (and its backward) ended: its group order drives the next prefetches."""
        if self._trace:
            self._last_trace = list(dict.fromkeys(self._trace))
            self._position = {g: i for i, g in enumerate(self._last_trace)}
            self._post_groups = self._after_last_block(self._last_trace)
            self._trace = []

    def _after_last_block(self, order: list[int]) -> frozenset[int]:
        """Groups after the last block in forward ``order`` (none in a model without blocks)."""
        blocks = [i for i, g in enumerate(order) if self.groups[g].is_block]
        return frozenset(order[blocks[-1] + 1 :]) if blocks else frozenset()
