"""The block probe: one block of each kind (``profiler.block_kind``: class and parameter shapes)
re-run on its own after the profiling step, with its activations kept, for what keeping costs
(saved bytes, transients) and how long the block takes without copy waits; its MLP alone
likewise (what tiling it would save)."""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from autooffload.errors import PlanError
from autooffload.log import logger
from autooffload.plan.profile_types import (
    PROBE_TILES,
    TILED_PEAK_FIELDS,
    TILED_PEAK_PREFIXES,
    UnitProfile,
    grown,
)
from autooffload.plan.search import MLP_TILE_TOKENS
from autooffload.runtime.activations import policies as activations
from autooffload.runtime.activations.model_activations import long_batch
from autooffload.runtime.activations.tiled_mlp import (
    find_mlp,
    find_norms,
    tile_mlp,
    tile_tokens_of,
    untile_mlp,
)

if TYPE_CHECKING:
    from autooffload.runtime.runtime import Runtime

# Runs per probe: the first pays one-time costs; the times are the best run's.
PROBE_RUNS = 3
# A long batch's block probe runs on slices whose kept block (about this many hidden states per
# position: a Llama block with its MLP keeps ~25) takes at most PROBE_BUDGET_SHARE of the budget.
PROBE_HIDDEN_STATES = 32
PROBE_BUDGET_SHARE = 0.25
# The shorter slice has at least this many positions (else the whole batch is probed).
MIN_PROBE_SLICE = 16
# A block's saved bytes grow quadratically (its other memory figures may too: ``growth``) where
# the fit's quadratic term at the batch is over this share of them.
QUADRATIC_MEMORY_SHARE = 0.01


def probe_slices(
    args: tuple, input_bytes: int, budget: int | None
) -> tuple[int, tuple[int, int, int]] | None:
    """``(seq, (t, 2t, 4t))``: the sequence length of a block call's ``(batch, seq, hidden)``
    input and the three slice lengths (powers of two, ``4t <= seq / 2``) its probe runs on, the
    longest one the longest whose kept block fits ``PROBE_BUDGET_SHARE`` of the budget; None
    where the input has another shape or no slice of ``MIN_PROBE_SLICE`` positions fits."""
    x = args[0] if args else None
    if budget is None or not isinstance(x, torch.Tensor) or x.dim() != 3:
        return None
    seq, hidden = x.shape[1], x.shape[2]
    if seq == hidden:
        return None
    per_position = input_bytes / seq
    limit = int(min(PROBE_BUDGET_SHARE * budget / (PROBE_HIDDEN_STATES * per_position), seq // 2))
    if limit < 4 * MIN_PROBE_SLICE:
        return None
    length = 1 << (limit.bit_length() - 1)  # the largest power of two within the limit
    return seq, (length // 4, length // 2, length)


def sliced(args: tuple, kwargs: dict, seq: int, length: int) -> tuple[tuple, dict]:
    """A block call's inputs on its first ``length`` positions: every tensor dimension of size
    ``seq`` (the hidden states', the position embeddings', a mask's two) cut to ``length``."""

    def cut(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or seq not in value.shape:
            return value
        index = tuple(slice(0, length) if size == seq else slice(None) for size in value.shape)
        return value[index].contiguous()

    return tree_map(cut, args), tree_map(cut, kwargs)


# Fields a sliced probe extrapolates (``profile_types.grown`` reads a name ending in "_bytes" as a
# byte count).
_EXTRAPOLATED = (
    "fwd_s",
    "bwd_s",
    "act_bytes_keep",
    "fwd_transient_bytes",
    "bwd_transient_bytes",
    "mlp_act_bytes",
    "mlp_fwd_transient_bytes",
    "mlp_bwd_transient_bytes",
    "mlp_fwd_s",
    "tiled_act_bytes_keep",
    *TILED_PEAK_FIELDS,
)


def growth(measured: list[tuple[int, dict[str, Any]]], seq: int) -> dict[str, tuple]:
    """Per field, ``(a, b, c)`` of ``a + b r + c r^2`` through its values at three slice
    lengths, with ``r`` the length as a share of ``seq`` (1 at the batch): constant parts
    (weights' views, launch overheads), linear ones (the projections, the MLP, flash attention's
    memory) and quadratic ones (attention's time, an eager attention's probabilities). Where the
    three points read negative curvature (noise), or a memory figure bends up while the saved
    bytes do not (``QUADRATIC_MEMORY_SHARE``), the line through the two longer ones."""
    lengths = [float(t) / seq for t, _ in measured]
    out: dict[str, tuple] = {}
    values_of: dict[str, list[float]] = {}
    for name in _EXTRAPOLATED:
        if any(name not in fields for _, fields in measured):
            continue
        values_of[name] = [float(fields[name]) for _, fields in measured]
        out[name] = _quadratic_through(lengths, values_of[name])
    keep = out.get("act_bytes_keep")
    # Memory grows quadratically only with what the block saves (eager attention's
    # probabilities). Where the saved bytes grow linearly, a peak's upward bend through three
    # short slices is a peak moving from one point of the block to another as they grow (the
    # larger of two linear terms), and extrapolated past the longest slice it overstates the
    # batch's (Llama 1.1B at 65536 tokens, slices of 4096-16384: 6.5 GiB for a tiled block's
    # backward against 3.1 by the line; the plan's peak was over-predicted by 35%).
    quadratic_memory = keep is None or keep[2] > QUADRATIC_MEMORY_SHARE * max(1.0, sum(keep))
    for name, (_, _, c) in list(out.items()):
        bytes_field = name.endswith("_bytes") and name != "act_bytes_keep"
        if c < 0 or (c > 0 and bytes_field and not quadratic_memory):
            # Noise, or a bend the saved bytes do not show: the line through the two longer.
            (t1, t2), (v1, v2) = lengths[1:], values_of[name][1:]
            b = (v2 - v1) / (t2 - t1)
            out[name] = (v2 - b * t2, b, 0.0)
    return out


def extrapolate(measured: list[tuple[int, dict[str, Any]]], seq: int) -> dict[str, Any]:
    """Each field at ``seq`` positions from its values at three slice lengths (``growth``),
    with the fit itself as ``growth``: what the profile scales by to another length
    (``ModelProfile.with_sequence_scaled``)."""
    fit = tuple((name, *abc) for name, abc in growth(measured, seq).items())
    return {**grown(fit, 1.0), "growth": fit}


def _quadratic_through(x: list[float], y: list[float]) -> tuple[float, float, float]:
    """``(a, b, c)`` of the parabola ``a + b x + c x^2`` through three points (Newton's divided
    differences)."""
    (x0, x1, x2), (y0, y1, y2) = x, y
    d01 = (y1 - y0) / (x1 - x0)
    d12 = (y2 - y1) / (x2 - x1)
    c = (d12 - d01) / (x2 - x0)
    b = d01 - c * (x0 + x1)
    a = y0 - b * x0 - c * x0 * x0
    return a, b, c


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
def gradient_hooks_set_aside(block: nn.Module) -> Iterator[None]:
    """Run with the backward hooks of ``block``'s modules and the gradient hooks of its params
    set aside: the probe's gradients are not the step's, and a user's hook reading gradients
    (logging, clipping per param, statistics) sees only the step's. Its forward hooks stay:
    they may change what the block computes, and the probe times the block as the step runs it."""
    modules = [(m, m._backward_pre_hooks, m._backward_hooks) for m in block.modules()]
    for module, _, _ in modules:
        module._backward_pre_hooks = OrderedDict()
        module._backward_hooks = OrderedDict()
    # Emptied in place: autograd calls the table it was given at the first registration.
    tables = [p._backward_hooks for p in block.parameters()]
    params = [(table, dict(table)) for table in tables if table]
    for table, _ in params:
        table.clear()
    try:
        yield
    finally:
        for module, pre_hooks, hooks in modules:
            module._backward_pre_hooks = pre_hooks
            module._backward_hooks = hooks
        for table, hooks in params:
            table.update(hooks)


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
        own step and the gradient hooks aside: ``gradient_hooks_set_aside``), as in the step:
        where the launching thread is the bottleneck (a small block at a short batch), the call
        path is part of the time.
        ``checkpoint_bytes``: the block's input as the step saw it; ``chunked_trainable``: which
        params' gradients the cost model counts apart. Its MLP runs untiled (the profile is the
        untiled one). A long batch's block runs on three slices of its sequence instead,
        extrapolated to the whole (``probe_slices``, ``extrapolate``)."""
        runtime = self.runtime
        policy = activations.policy_of(block)
        activations.remove_policy(block)
        mlp = find_mlp(block)
        # A long batch's profiling steps tile the MLP and the norms; the probe runs them whole.
        tiled = [(m, tile_tokens_of(m)) for m in (mlp, *find_norms(block)) if tile_tokens_of(m)]
        for module, _ in tiled:
            untile_mlp(module)  # type: ignore[arg-type]
        chunks = runtime.layout.chunks_of_group[group_index]
        for index in chunks:
            runtime.manager.gather(index)
        params = [p for p in block.parameters() if p.requires_grad]
        # A KV cache the step's forward wrote to would be appended to again by every run.
        kwargs = {k: v for k, v in kwargs.items() if not activations.is_kv_cache(k, v)}
        caches = activations.positional_kv_caches(args)
        args = tuple(None if i in caches else a for i, a in enumerate(args))
        if "use_cache" in kwargs:
            kwargs["use_cache"] = False
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        tokens = first.numel() // max(1, first.shape[-1]) if first is not None else 0
        tiled_probe = mlp is not None and tokens > min(MLP_TILE_TOKENS)
        n_blocks = sum(g.is_block for g in runtime.groups)
        slices = None
        if long_batch(n_blocks, checkpoint_bytes, runtime.plan.budget_bytes):
            slices = probe_slices(args, checkpoint_bytes, runtime.plan.budget_bytes)
        try:
            with (
                runtime.step_state.probe(),
                gradient_hooks_set_aside(block),
                activations.running_stats_frozen(block),
            ):

                def measure(call_args: tuple, call_kwargs: dict) -> dict[str, Any]:
                    return self._measure(
                        block, call_args, call_kwargs, params, mlp, chunked_trainable, tiled_probe
                    )

                fields = None
                if slices is not None:
                    seq, lengths = slices
                    fields = self._sliced(measure, args, kwargs, seq, lengths, type(block).__name__)
                if fields is None:
                    fields = measure(args, kwargs)
        finally:
            for index in chunks:
                runtime.manager.release(index)
            if policy != "keep":
                runtime.activations.apply_block_policy(block, policy)
            for module, tiles in tiled:
                tile_mlp(module, tiles)  # type: ignore[arg-type]
        return UnitProfile(
            act_bytes_checkpoint=checkpoint_bytes, name=type(block).__name__, **fields
        )

    @staticmethod
    def _sliced(
        measure: Callable[[tuple, dict], dict[str, Any]],
        args: tuple,
        kwargs: dict,
        seq: int,
        lengths: tuple[int, ...],
        name: str,
    ) -> dict[str, Any] | None:
        """The block's fields ``measure``-d on the first ``lengths`` positions of its sequence
        and extrapolated to ``seq``; None where a slice does not run (then the whole batch
        runs)."""
        measured = []
        for length in lengths:
            try:
                fields = measure(*sliced(args, kwargs, seq, length))
            except (RuntimeError, ValueError, IndexError) as error:
                logger.debug("block probe on %d of %d positions failed: %s", length, seq, error)
                return None
            measured.append((length, fields))
        logger.info(
            "block probe of a long batch: %s measured on %s of %d positions",
            name,
            ", ".join(str(t) for t in lengths),
            seq,
        )
        return extrapolate(measured, seq)

    def _measure(
        self,
        block: nn.Module,
        args: tuple,
        kwargs: dict,
        params: list,
        mlp: nn.Module | None,
        chunked_trainable: Callable[[Iterable[torch.Tensor]], list[torch.Tensor]],
        tiled_probe: bool = False,
    ) -> dict[str, Any]:
        """The block's ``UnitProfile`` fields (its MLP's included) on these inputs; with
        ``tiled_probe``, also its peaks with the MLP and norms in ``PROBE_TILES``,
        ``PROBE_FINE_TILES`` and ``PROBE_COARSE_TILES`` tiles."""
        saved = [0]
        norms = find_norms(block) if mlp is not None else []
        inputs: list[list[torch.Tensor]] = [[] for _ in range(1 + len(norms))]
        mlp_fields: dict[str, Any] = {}
        # The first run pays one-time costs (allocator growth, kernel selection); the timings
        # are the best of PROBE_RUNS, the memory figures those of the last run.
        best = (float("inf"), float("inf"))
        for _ in range(PROBE_RUNS):
            saved[0] = 0
            with contextlib.ExitStack() as stack:
                for module, captured in zip((mlp, *norms), inputs, strict=True):
                    stack.enter_context(_capture_input(module, captured))
                measured = self._once(block, self._inputs(args), kwargs, params, saved)
            fwd_s, bwd_s, kept, fwd_peak, bwd_peak = measured
            best = (min(best[0], fwd_s), min(best[1], bwd_s))
        fwd_s, bwd_s = best
        if mlp is not None and inputs[0]:
            mlp_fields = self._mlp(mlp, inputs[0][-1], chunked_trainable)
            # The norms are tiled with the MLP: what they save beyond their input, and the
            # forward their tiles run again, count with the MLP's.
            for norm, captured in zip(norms, inputs[1:], strict=True):
                if captured:
                    extra = self._mlp(norm, captured[-1], chunked_trainable)
                    mlp_fields["mlp_act_bytes"] += extra["mlp_act_bytes"]
                    mlp_fields["mlp_fwd_s"] += extra["mlp_fwd_s"]
            if tiled_probe:
                tiled = (mlp, *norms)
                mlp_fields.update(
                    self._tiled(block, args, kwargs, params, tiled, chunked_trainable)
                )
                for tiles, prefix in TILED_PEAK_PREFIXES:
                    if tiles == PROBE_TILES:
                        continue  # the run above
                    other = self._tiled(
                        block, args, kwargs, params, tiled, chunked_trainable, tiles
                    )
                    for side in ("fwd", "bwd"):
                        key = f"tiled_{prefix}{side}_peak_bytes"
                        mlp_fields[key] = other[f"tiled_{side}_peak_bytes"]
        # The probe's backward allocates the block's parameter gradients; the cost model adds
        # them (offloaded and persistent grads per unit), so they leave the transient, which
        # may go negative (down to -kept: activations are freed as the gradients are made).
        bwd_transient = self._bwd_transient(kept, bwd_peak, chunked_trainable(params))
        return {
            "fwd_s": fwd_s,
            "bwd_s": bwd_s,
            "act_bytes_keep": int(kept),
            "fwd_transient_bytes": int(max(0, fwd_peak - kept)),
            "bwd_transient_bytes": int(bwd_transient),
            **mlp_fields,
        }

    def _tiled(
        self,
        block: nn.Module,
        args: tuple,
        kwargs: dict,
        params: list,
        tiled: tuple,
        chunked_trainable: Callable[[Iterable[torch.Tensor]], list[torch.Tensor]],
        tiles: int = PROBE_TILES,
    ) -> dict[str, int]:
        """The block with the ``tiled`` modules (its MLP and norms) in ``tiles`` tiles:
        what it saves, its input included where a tiled norm saves it (an untiled RMSNorm saves
        an fp32 copy instead, so the input was freed after the block), and its forward and
        backward peaks above its input with those saved bytes, its parameter gradients aside
        (``UnitProfile.tiled_act_bytes_keep``, ``tiled_fwd_peak_bytes``,
        ``tiled_bwd_peak_bytes``)."""
        x = args[0]
        tile = max(1, x.numel() // max(1, x.shape[-1]) // tiles)
        inputs = self._inputs(args)
        storage = inputs[0].untyped_storage().data_ptr()
        input_saved = [False]

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() == storage:
                input_saved[0] = True
            return t

        # On the CPU the probe's own saved-bytes count sees the input; on the GPU the allocator
        # counted it before the forward.
        spotting = (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            if self.clock.cuda
            else contextlib.nullcontext()
        )
        for module in tiled:
            tile_mlp(module, tile)
        try:
            with spotting:
                _, _, kept, fwd_peak, bwd_peak = self._once(block, inputs, kwargs, params, [0])
        finally:
            for module in tiled:
                untile_mlp(module)
        bwd_transient = self._bwd_transient(kept, bwd_peak, chunked_trainable(params))
        if input_saved[0] and self.clock.cuda:
            x_bytes = inputs[0].numel() * inputs[0].element_size()
            kept, fwd_peak = kept + x_bytes, fwd_peak + x_bytes
        return {
            "tiled_act_bytes_keep": int(kept),
            "tiled_fwd_peak_bytes": int(max(kept, fwd_peak)),
            "tiled_bwd_peak_bytes": int(kept + bwd_transient),
        }

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
        bwd_transient = self._bwd_transient(kept, bwd_peak, chunked_trainable(params))
        return {
            "mlp_act_bytes": int(kept),
            "mlp_fwd_transient_bytes": int(max(0, fwd_peak - kept)),
            "mlp_bwd_transient_bytes": int(bwd_transient),
            "mlp_fwd_s": best_s,
        }

    def _bwd_transient(self, kept: int, bwd_peak: int, trainable: list) -> int:
        """A backward's peak above its start less the gradients of ``trainable`` (the cost
        model counts them), down to ``-kept`` (saved tensors freed as gradients are made); on
        the CPU, where no gradients are counted, the peak itself."""
        if not self.clock.cuda:
            return max(0, bwd_peak)
        return max(-int(kept), bwd_peak - grad_bytes(trainable))

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
            # A param the block's forward leaves out of the graph (a submodule run under
            # no_grad, a branch not taken) has no gradient, as in the step.
            try:
                torch.autograd.grad(first, grad_inputs, torch.ones_like(first), allow_unused=True)
            except RuntimeError as error:
                if "use_reentrant" not in str(error):
                    raise
                raise PlanError(
                    f"autooffload: the profiling step cannot time the backward of a"
                    f" {type(block).__name__} block alone: its forward calls"
                    " torch.utils.checkpoint(..., use_reentrant=True), which only a whole"
                    " backward() can run; pass use_reentrant=False there, or drop the call"
                    " (autooffload checkpoints blocks itself)"
                ) from error
        bend = self.clock.mark()
        bwd_peak = self.clock.peak() - before_bwd
        fwd_s = self.clock.seconds(start, end)
        bwd_s = self.clock.seconds(bstart, bend)
        return fwd_s, bwd_s, int(kept), int(fwd_peak), int(bwd_peak)
