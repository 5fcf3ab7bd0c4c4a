"""The block probe: one block of each class re-run on its own after the profiling step, with
its activations kept, for what keeping costs (saved bytes, transients) and how long the block
takes without copy waits; its MLP alone likewise (what tiling it would save)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autooffload.plan.profile_types import UnitProfile
from autooffload.runtime.activations import policies as activations
from autooffload.runtime.activations.tiled_mlp import find_mlp

if TYPE_CHECKING:
    from autooffload.runtime.runtime import Runtime

# Runs per probe: the first pays one-time costs; the times are the best run's.
PROBE_RUNS = 3


class Clock:
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


def grad_bytes(params: Iterable[torch.Tensor]) -> int:
    """Bytes of the gradients of ``params`` (a gradient has its parameter's dtype and shape)."""
    return sum(p.numel() * p.element_size() for p in params)


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


class BlockProbe:
    """Runs blocks (and their MLPs) alone on the device under the runtime's probe phase."""

    def __init__(self, runtime: Runtime, clock: Clock) -> None:
        self.runtime = runtime
        self.clock = clock

    def run(
        self,
        block: nn.Module,
        group_index: int,
        args: tuple,
        kwargs: dict,
        checkpoint_bytes: int,
        chunked_trainable: Callable[[Iterable[torch.Tensor]], list[torch.Tensor]],
    ) -> UnitProfile:
        """Run one block on its own: saved bytes, transients, forward and backward times. The
        block runs through its ``__call__`` (the hooks of HF and others with it; the runtime's
        own step aside), as in the step: where the launching thread is the bottleneck (a small
        block at a short batch), the call path is part of the time. ``checkpoint_bytes``: the
        block's input as the step saw it; ``chunked_trainable``: which params' gradients the
        cost model counts apart."""
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
                        measured = self._once(block, self._inputs(args), kwargs, params, saved)
                    fwd_s, bwd_s, kept, fwd_peak, bwd_peak = measured
                    best = (min(best[0], fwd_s), min(best[1], bwd_s))
                fwd_s, bwd_s = best
                if mlp is not None and mlp_inputs:
                    mlp_fields = self._mlp(mlp, mlp_inputs[-1], chunked_trainable)
        finally:
            for index in chunks:
                runtime.manager.release(index)
            if policy != "keep":
                runtime.activations.apply_block_policy(block, policy)
        # The probe's backward allocates the block's parameter gradients; the cost model adds
        # them (offloaded and persistent grads per unit), so they leave the transient, which
        # may go negative (down to -kept: activations are freed as the gradients are made).
        bwd_transient = max(0, bwd_peak)
        if self.clock.cuda:
            bwd_transient = max(-int(kept), bwd_peak - grad_bytes(chunked_trainable(params)))
        return UnitProfile(
            fwd_s=fwd_s,
            bwd_s=bwd_s,
            act_bytes_keep=int(kept),
            act_bytes_checkpoint=checkpoint_bytes,
            fwd_transient_bytes=int(max(0, fwd_peak - kept)),
            bwd_transient_bytes=int(bwd_transient),
            name=type(block).__name__,
            **mlp_fields,
        )

    def _mlp(
        self,
        mlp: nn.Module,
        x: torch.Tensor,
        chunked_trainable: Callable[[Iterable[torch.Tensor]], list[torch.Tensor]],
    ) -> dict[str, Any]:
        """Run a block's MLP on its own, on the input it had in the block: the bytes it saves
        beyond that input, its own transients and its forward time (``UnitProfile.mlp_*``)."""
        params = [p for p in mlp.parameters() if p.requires_grad]
        saved = [0]
        best_s = float("inf")
        for _ in range(2):
            saved[0] = 0
            inputs = self._inputs((x,))
            fwd_s, _, kept, fwd_peak, bwd_peak = self._once(
                mlp, inputs, {}, params, saved, skip=inputs[0]
            )
            best_s = min(best_s, fwd_s)
        bwd_transient = max(0, bwd_peak)
        if self.clock.cuda:
            bwd_transient = max(-int(kept), bwd_peak - grad_bytes(chunked_trainable(params)))
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

    def _once(
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
