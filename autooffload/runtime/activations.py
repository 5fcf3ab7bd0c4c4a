"""Per-block activation policies: keep, checkpoint, swap to host memory, or checkpoint from host.

A transformer block saves tensors for its backward ("activations"). Each block gets one policy:

* ``keep``: plain autograd; nothing is installed.
* ``checkpoint``: non-reentrant :func:`torch.utils.checkpoint.checkpoint`; only the block input is
  kept and the block's forward is re-run inside its backward (RNG state restored, so dropout
  draws the same mask).
* ``swap``: every saved tensor of at least ``min_swap_bytes`` is copied to host memory during the
  forward and copied back before the block's backward needs it (:class:`ActivationSwapper`).
* ``checkpoint_cpu``: ``checkpoint`` whose one saved tensor, the block input, is itself swapped,
  so a checkpointed block keeps nothing large on the device.

The policy is a wrapper around ``block.forward`` (an instance attribute, removed exactly by
:func:`remove_policy`). It runs inside ``nn.Module.__call__``, so hooks registered on the block
fire once around it and are never re-run by a recompute. A recompute runs inside the block's
backward; while it runs, :func:`is_recomputing` is true in that thread and the optional
``on_recompute_start(block)`` callback has been called, so hooks on sub-modules can tell a
recompute from a first forward.

The swap protocol, in plain words (CUDA; on a CPU "device" the same code runs with plain copies):

1. Pack (forward, compute stream). A saved tensor that is small, a parameter (or a view of one),
   or not an ordinary strided tensor is kept as it is. Otherwise the D2H stream first waits for
   the compute stream (the tensor must be computed before it is read), then copies it into a
   pinned buffer from :class:`HostBufferPool` and records a D2H event. The swapper keeps the
   device tensor alive meanwhile: its memory must not go to a new kernel before the copy has
   read it. When block ``i``'s forward ends, the compute stream waits for the D2H events of the
   blocks before ``i`` and their device tensors are dropped, so block ``i - 1``'s copies overlap
   block ``i``'s compute, at most two blocks of copies are in flight, and the memory is freed at a
   known point (the allocator reuses it in stream order); the last ones go when backward starts.
   The same tensor saved twice (same base tensor, storage offset, shape, strides and dtype, the
   base still alive) is copied once; both saves share one record.
2. Prefetch (backward). ``prefetch(i)``, called by the runtime from block ``i + 1``'s pre-backward
   hook, and on its own by the first unpack of a block for the swapped block before it, allocates
   the device copies on the compute stream, lets the H2D stream wait for the compute stream (the
   allocator may hand out memory the compute stream is still using) and for the D2H event, copies
   back, and records an H2D event.
3. Unpack (backward, compute stream). The compute stream waits for the H2D event and autograd gets
   the device copy; an unprefetched record is brought back on demand first.
4. Release. A record lives as long as autograd holds it (until its node has run). When it dies
   its host buffer goes back to the pool tagged with the H2D event, which the next D2H into that
   buffer waits for; pinned memory is allocated in the first step only.

Nesting: a swap block entered while other saved-tensor hooks are active (an outer
``torch.utils.checkpoint``, ``save_on_cpu``, or a checkpoint's recompute) runs as ``keep``: the
outer hooks already own those tensors. Inside a swap block, a ``torch.utils.checkpoint`` of the
user's own keeps working: its saved inputs are swapped, the tensors it recomputes are not.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from autooffload.errors import PlanError
from autooffload.log import logger

Policy = Literal["keep", "checkpoint", "swap", "checkpoint_cpu"]
POLICIES: tuple[str, ...] = ("keep", "checkpoint", "swap", "checkpoint_cpu")
DEFAULT_MIN_SWAP_BYTES = 1 << 20

_POLICY_ATTR = "_autooffload_activation_policy"
_HF_ATTR = "_autooffload_hf_checkpointing"
_recompute_state = threading.local()
_MISSING = object()


# --------------------------------------------------------------------------- recompute flag


def is_recomputing() -> bool:
    """True while a checkpointed block (or a tiled MLP) re-runs its forward inside backward."""
    return getattr(_recompute_state, "module", None) is not None


def recomputing_module() -> nn.Module | None:
    """The block (or MLP) whose forward is being recomputed in this thread, else ``None``."""
    return getattr(_recompute_state, "module", None)


@contextlib.contextmanager
def recomputing(
    module: nn.Module, on_start: Callable[[nn.Module], None] | None = None
) -> Iterator[None]:
    """Mark this thread as recomputing ``module``'s forward (calls ``on_start(module)`` first)."""
    if on_start is not None:
        on_start(module)
    previous = getattr(_recompute_state, "module", None)
    _recompute_state.module = module
    try:
        yield
    finally:
        _recompute_state.module = previous


# --------------------------------------------------------------------------- host buffers


def _size_class(nbytes: int) -> int:
    # Round up to 1/8 of the power of two below: at most 12.5% waste, few distinct sizes to reuse.
    granule = max(4096, 1 << max(0, nbytes.bit_length() - 4))
    return -(-nbytes // granule) * granule


class _HostBuffer:
    __slots__ = ("data", "size_class", "ready")

    def __init__(self, data: torch.Tensor, size_class: int) -> None:
        self.data = data
        self.size_class = size_class
        self.ready: torch.cuda.Event | None = None  # last H2D read; the next D2H waits for it


class HostBufferPool:
    """Host buffers (pinned when ``pin_memory``) keyed by size class and reused across steps."""

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self._idle: dict[int, list[_HostBuffer]] = defaultdict(list)
        self._lock = threading.Lock()
        self.allocations = 0
        self.allocated_bytes = 0
        self.reuses = 0
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0

    def acquire(self, nbytes: int) -> _HostBuffer:
        """A buffer of at least ``nbytes``: an idle one of the same size class, else a new one."""
        size_class = _size_class(nbytes)
        with self._lock:
            idle = self._idle[size_class]
            if idle:
                buffer = idle.pop()
                self.reuses += 1
            else:
                data = torch.empty(size_class, dtype=torch.uint8, pin_memory=self.pin_memory)
                buffer = _HostBuffer(data, size_class)
                self.allocations += 1
                self.allocated_bytes += size_class
            self.in_use_bytes += size_class
            self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return buffer

    def release(self, buffer: _HostBuffer) -> None:
        """Give ``buffer`` back for reuse."""
        with self._lock:
            self.in_use_bytes -= buffer.size_class
            self._idle[buffer.size_class].append(buffer)

    def clear(self) -> None:
        """Free every idle buffer (buffers in use are freed when released and dropped)."""
        with self._lock:
            for idle in self._idle.values():
                self.allocated_bytes -= sum(b.size_class for b in idle)
            self._idle.clear()

    def stats(self) -> dict[str, int]:
        """Allocation counters: a steady state has ``allocations`` constant across steps."""
        return {
            "host_allocations": self.allocations,
            "host_allocated_bytes": self.allocated_bytes,
            "host_reuses": self.reuses,
            "host_in_use_bytes": self.in_use_bytes,
            "host_peak_in_use_bytes": self.peak_in_use_bytes,
        }


# --------------------------------------------------------------------------- swapper


class _Swapped:
    """One swapped tensor: its host copy, how to rebuild it, and its device copy once back."""

    __slots__ = (
        "pool", "block_index", "buffer", "host", "size", "stride", "dtype", "device",
        "compute_stream", "d2h_event", "h2d_event", "device_copy", "consumed", "__weakref__",
    )  # fmt: skip

    def __init__(
        self, pool: HostBufferPool, buffer: _HostBuffer, host: torch.Tensor, block_index: int,
        t: torch.Tensor,
    ) -> None:  # fmt: skip
        self.pool, self.buffer, self.host, self.block_index = pool, buffer, host, block_index
        self.size, self.stride, self.dtype, self.device = t.shape, host.stride(), t.dtype, t.device
        self.compute_stream: torch.cuda.Stream | None = None
        self.d2h_event: torch.cuda.Event | None = None
        self.h2d_event: torch.cuda.Event | None = None
        self.device_copy: torch.Tensor | None = None
        self.consumed = False

    def __del__(self) -> None:
        if self.device_copy is not None and not self.consumed and self.h2d_event is not None:
            # Prefetched but never unpacked: the compute stream may reuse the copy's memory only
            # after the H2D that writes it has finished.
            self.compute_stream.wait_event(self.h2d_event)
        self.pool.release(self.buffer)


class ActivationSwapper:
    """Moves the saved tensors of ``swap`` / ``checkpoint_cpu`` blocks to host memory and back.

    ``device`` is the compute device ("cuda[:i]", or "cpu" for CPU simulation: same logic, plain
    copies, no streams). ``param_storage_ptrs`` are storage pointers that are never copied (e.g.
    the runtime's chunk buffers); the block's own parameters and buffers are added per forward.
    """

    def __init__(
        self,
        device: torch.device | str,
        min_swap_bytes: int = DEFAULT_MIN_SWAP_BYTES,
        param_storage_ptrs: Iterable[int] = (),
        pin_memory: bool | None = None,
    ) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.min_swap_bytes = min_swap_bytes
        self.param_storage_ptrs = set(param_storage_ptrs)
        use_cuda = self.device.type == "cuda"
        self.pool = HostBufferPool(use_cuda if pin_memory is None else pin_memory)
        self.d2h_stream = torch.cuda.Stream(self.device) if use_cuda else None
        self.h2d_stream = torch.cuda.Stream(self.device) if use_cuda else None
        self._records: dict[int, list[weakref.ref[_Swapped]]] = defaultdict(list)
        self._saved: dict[tuple, tuple[weakref.ref, weakref.ref[_Swapped]]] = {}
        self._index_of: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
        self._in_backward = False
        self._last_forward_index = -1
        self._unpacking_index: int | None = None
        self._in_flight: dict[int, tuple[torch.cuda.Event, list[torch.Tensor]]] = {}
        self.reset_stats()

    def reset_stats(self) -> None:
        """Zero the transfer counters (pool counters are cumulative)."""
        self.counters = dict.fromkeys(
            ("swapped_tensors", "d2h_bytes", "deduped_tensors", "deduped_bytes", "kept_small",
             "kept_params", "kept_other", "h2d_bytes", "prefetched_tensors", "on_demand_tensors",
             "nested_skips"),
            0,
        )  # fmt: skip

    def stats(self) -> dict[str, int]:
        """Transfer counters plus the host pool's allocation counters."""
        return {**self.counters, **self.pool.stats()}

    def index_for(self, block: nn.Module) -> int:
        """The block's swap index: the next free one, in the order blocks are first seen."""
        if block not in self._index_of:
            self._index_of[block] = len(self._index_of)
        return self._index_of[block]

    @contextlib.contextmanager
    def saving(self, block_index: int, params: Iterable[torch.Tensor] = ()) -> Iterator[None]:
        """Swap the tensors saved for backward inside this context as block ``block_index``'s."""
        if self._in_backward or block_index <= self._last_forward_index:
            self._saved.clear()  # a new forward: old dedupe keys may point at reused memory
            self._in_backward = False
            self.release_in_flight()
        self._last_forward_index = block_index
        records = self._records[block_index]
        records[:] = [r for r in records if r() is not None]
        param_ptrs = self.param_storage_ptrs | {p.untyped_storage().data_ptr() for p in params}
        pack = functools.partial(self._pack, block_index=block_index, param_ptrs=param_ptrs)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
                yield
        finally:
            self.release_in_flight(before=block_index)

    def release_in_flight(self, before: int | None = None) -> None:
        """Drop the device tensors whose D2H is done, for blocks before ``before`` (all: None).

        The compute stream waits for those blocks' D2H events first, so their memory is reused
        only after the copies have read it.
        """
        for index in [i for i in self._in_flight if before is None or i < before]:
            event, _ = self._in_flight.pop(index)
            torch.cuda.current_stream(self.device).wait_event(event)

    def prefetch(self, block_index: int) -> None:
        """Start bringing block ``block_index``'s swapped tensors back (no-op if none)."""
        self._enter_backward()
        for ref in self._records.get(block_index, ()):
            record = ref()
            if record is not None and record.device_copy is None:
                self._bring_back(record)
                self.counters["prefetched_tensors"] += 1

    # -- pack / unpack

    def _keep_reason(self, t: torch.Tensor, param_ptrs: set[int]) -> str | None:
        if isinstance(t, nn.Parameter):
            return "kept_params"
        if type(t) is not torch.Tensor or t.layout != torch.strided or t.device != self.device:
            return "kept_other"
        if t.numel() * t.element_size() < self.min_swap_bytes:
            return "kept_small"
        if t.untyped_storage().data_ptr() in param_ptrs:
            return "kept_params"
        return None

    def _pack(self, t: torch.Tensor, block_index: int, param_ptrs: set[int]) -> Any:
        reason = self._keep_reason(t, param_ptrs)
        if reason is not None:
            self.counters[reason] += 1
            return t
        nbytes = t.numel() * t.element_size()
        anchor = t._base if t._base is not None else t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)
        seen = self._saved.get(key)
        if seen is not None:
            anchor_ref, record_ref = seen
            record = record_ref()
            # Equal keys mean equal data only while the first tensor's memory is still alive.
            if record is not None and anchor_ref() is anchor:
                self.counters["deduped_tensors"] += 1
                self.counters["deduped_bytes"] += nbytes
                return record
        record = self._swap_out(t, nbytes, block_index)
        self._saved[key] = (weakref.ref(anchor), weakref.ref(record))
        self._records[block_index].append(weakref.ref(record))
        self.counters["swapped_tensors"] += 1
        self.counters["d2h_bytes"] += nbytes
        return record

    def _swap_out(self, t: torch.Tensor, nbytes: int, block_index: int) -> _Swapped:
        # A dense copy keeps t's layout (e.g. a transpose) so backward kernels see the same strides.
        stride = t.stride() if t.is_contiguous() else torch.empty_like(t, device="meta").stride()
        buffer = self.pool.acquire(nbytes)
        host = buffer.data[:nbytes].view(t.dtype).as_strided(t.shape, stride)
        record = _Swapped(self.pool, buffer, host, block_index, t)
        if self.d2h_stream is None:
            host.copy_(t)
            return record
        compute = torch.cuda.current_stream(t.device)
        record.compute_stream = compute
        self.d2h_stream.wait_stream(compute)
        if buffer.ready is not None:
            self.d2h_stream.wait_event(buffer.ready)
        with torch.cuda.stream(self.d2h_stream):
            host.copy_(t, non_blocking=True)
        record.d2h_event = self.d2h_stream.record_event()
        _, tensors = self._in_flight.get(block_index, (None, []))
        tensors.append(t)
        self._in_flight[block_index] = (record.d2h_event, tensors)
        return record

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        record: _Swapped = packed
        if not self._in_backward:
            self._enter_backward()
        if record.device_copy is None:
            self._bring_back(record)
            self.counters["on_demand_tensors"] += 1
        if record.block_index != self._unpacking_index:
            self._unpacking_index = record.block_index
            self._prefetch_previous(record.block_index)
        if record.h2d_event is not None:
            torch.cuda.current_stream(record.device).wait_event(record.h2d_event)
        record.consumed = True
        return record.device_copy

    def _prefetch_previous(self, block_index: int) -> None:
        # Overlap the H2D of the next block backward needs with this block's backward compute.
        earlier = [i for i, refs in self._records.items() if i < block_index and refs]
        if earlier:
            self.prefetch(max(earlier))

    def _bring_back(self, record: _Swapped) -> None:
        if self.h2d_stream is None:
            record.device_copy = torch.empty_strided(
                record.size, record.stride, dtype=record.dtype, device=record.device
            ).copy_(record.host)
        else:
            compute = record.compute_stream
            with torch.cuda.stream(compute):
                device_copy = torch.empty_strided(
                    record.size, record.stride, dtype=record.dtype, device=record.device
                )
            self.h2d_stream.wait_stream(compute)
            self.h2d_stream.wait_event(record.d2h_event)
            with torch.cuda.stream(self.h2d_stream):
                device_copy.copy_(record.host, non_blocking=True)
            record.h2d_event = self.h2d_stream.record_event()
            record.buffer.ready = record.h2d_event
            record.device_copy = device_copy
        self.counters["h2d_bytes"] += record.host.numel() * record.host.element_size()

    def _enter_backward(self) -> None:
        if not self._in_backward:
            self._unpacking_index = None
            self.release_in_flight()
        self._in_backward = True
        self._last_forward_index = -1
        self._saved.clear()


def _outer_hooks_active() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


# --------------------------------------------------------------------------- block policies


@dataclass(eq=False)
class BlockActivationPolicy:
    """What :func:`apply_policy` installed on one block; :func:`remove_policy` undoes it."""

    block: nn.Module
    policy: str
    swapper: ActivationSwapper | None
    block_index: int
    on_recompute_start: Callable[[nn.Module], None] | None
    inner_forward: Callable[..., Any]
    prior_forward: Callable[..., Any] | None
    wrapper: Callable[..., Any] | None = None
    active: bool = True


def apply_policy(
    block: nn.Module,
    policy: Policy,
    swapper: ActivationSwapper | None = None,
    *,
    block_index: int | None = None,
    on_recompute_start: Callable[[nn.Module], None] | None = None,
) -> None:
    """Give ``block`` the activation ``policy`` (replacing any earlier one).

    ``swap`` and ``checkpoint_cpu`` need ``swapper``; ``block_index`` orders blocks for
    ``swapper.prefetch`` (default: the order blocks are first seen by the swapper).
    ``on_recompute_start(block)`` is called when a checkpointed block starts its recompute.
    """
    if policy not in POLICIES:
        raise PlanError(
            f"activation policy {policy!r} for {type(block).__name__} is not one of {POLICIES}"
        )
    if policy in ("swap", "checkpoint_cpu") and swapper is None:
        raise PlanError(f"activation policy {policy!r} needs an ActivationSwapper; pass swapper=")
    remove_policy(block)
    if policy == "keep":
        return
    if block_index is None:
        block_index = swapper.index_for(block) if swapper is not None else -1
    state = BlockActivationPolicy(
        block=block,
        policy=policy,
        swapper=swapper,
        block_index=block_index,
        on_recompute_start=on_recompute_start,
        inner_forward=block.forward,
        prior_forward=block.__dict__.get("forward"),
    )

    def forward(*args: Any, **kwargs: Any) -> Any:
        return _run_block(state, args, kwargs)

    functools.update_wrapper(forward, state.inner_forward)
    state.wrapper = forward
    block.__dict__["forward"] = forward
    block.__dict__[_POLICY_ATTR] = state


def remove_policy(block: nn.Module) -> None:
    """Undo :func:`apply_policy`: ``block.forward`` is again what it was before."""
    state: BlockActivationPolicy | None = block.__dict__.pop(_POLICY_ATTR, None)
    if state is None:
        return
    state.active = False
    if block.__dict__.get("forward") is not state.wrapper:
        # Someone wrapped forward after us; unwrapping would drop their wrapper, so ours passes
        # through from now on.
        logger.debug("activation policy of %s left as a pass-through", type(block).__name__)
        return
    if state.prior_forward is None:
        del block.__dict__["forward"]
    else:
        block.__dict__["forward"] = state.prior_forward


def policy_of(block: nn.Module) -> str:
    """The activation policy installed on ``block`` ("keep" when none)."""
    state = block.__dict__.get(_POLICY_ATTR)
    return "keep" if state is None else state.policy


def _run_block(state: BlockActivationPolicy, args: tuple, kwargs: dict) -> Any:
    inner = state.inner_forward
    if not state.active or not torch.is_grad_enabled():
        return inner(*args, **kwargs)
    block, swapper = state.block, state.swapper
    if state.policy == "swap":
        if _outer_hooks_active():
            swapper.counters["nested_skips"] += 1
            return inner(*args, **kwargs)
        if block.training:
            kwargs = _without_cache(block, kwargs)
        with swapper.saving(state.block_index, _params_and_buffers(block)):
            return inner(*args, **kwargs)

    def recompute_contexts() -> tuple[contextlib.AbstractContextManager, ...]:
        return contextlib.nullcontext(), recomputing(block, state.on_recompute_start)

    # kwargs go in a partial so none can collide with checkpoint's own keyword arguments.
    run = functools.partial(
        checkpoint,
        functools.partial(inner, **_without_cache(block, kwargs)),
        *args,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=recompute_contexts,
    )
    if state.policy == "checkpoint_cpu" and not _outer_hooks_active():
        with swapper.saving(state.block_index):
            return run()
    return run()


def _params_and_buffers(block: nn.Module) -> Iterator[torch.Tensor]:
    yield from block.parameters()
    yield from block.buffers()


def _without_cache(block: nn.Module, kwargs: dict) -> dict:
    # As HF's own checkpointing does: a recompute would append to a KV cache a second time, and a
    # cache holding device K/V would pin swapped activations on the device.
    changed = dict(kwargs)
    if changed.get("use_cache"):
        changed["use_cache"] = False
    if not getattr(block, "_can_checkpoint_with_cache", False):
        for name in ("past_key_values", "past_key_value", "layer_past"):
            if changed.get(name) is not None:
                changed[name] = None
    if changed != kwargs:
        logger.debug("%s: KV cache disabled for a training forward", type(block).__name__)
    return changed


# --------------------------------------------------------------------------- HF checkpointing


def take_over_hf_gradient_checkpointing(model: nn.Module) -> bool:
    """Turn off HF's per-layer gradient checkpointing so autooffload's policy is the only one.

    Returns whether any module had it on (the caller logs that once). The modules HF had
    checkpointing on for are kept; :func:`hf_checkpointed_modules` lists them and
    :func:`restore_hf_gradient_checkpointing` turns them back on.
    """
    flagged = [m for m in model.modules() if getattr(m, "gradient_checkpointing", None) is True]
    if not flagged:
        return False
    previous = model.__dict__.get(_HF_ATTR, [])
    for module in flagged:
        previous.append((module, module.__dict__.get("gradient_checkpointing", _MISSING)))
        module.gradient_checkpointing = False
    model.__dict__[_HF_ATTR] = previous
    return True


def hf_checkpointed_modules(model: nn.Module) -> tuple[nn.Module, ...]:
    """The modules HF had gradient checkpointing on for before it was taken over."""
    return tuple(module for module, _ in model.__dict__.get(_HF_ATTR, ()))


def restore_hf_gradient_checkpointing(model: nn.Module) -> None:
    """Undo :func:`take_over_hf_gradient_checkpointing`."""
    for module, value in reversed(model.__dict__.pop(_HF_ATTR, [])):
        if value is _MISSING:
            module.__dict__.pop("gradient_checkpointing", None)
        else:
            module.gradient_checkpointing = value
