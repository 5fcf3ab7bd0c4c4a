"""ActivationSwapper: saved tensors of swapped blocks go to pinned host memory and come back.

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
   buffer waits for; pinned memory is allocated in the first step only. A used device copy is
   freed in compute-stream order (the compute stream waited for its H2D); one never used (a
   backward cut short) is held for the H2D stream until its copy is done.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from autooffload.errors import HostMemoryError

DEFAULT_MIN_SWAP_BYTES = 1 << 20


# --------------------------------------------------------------------------- host buffers


# A buffer's bytes are its request rounded up to a granule: few distinct sizes to reuse. Below
# ``EXACT_PIN_BYTES`` the granule is 1/8 of the power of two below the request, from it 1/16:
# a buffer pinned alone is at most this share more than asked (the search's host room counts
# it: ``control/host_need.py``).
SIZE_CLASS_ROUNDING = 1 / 16


def _size_class(nbytes: int) -> int:
    shift = 5 if nbytes >= EXACT_PIN_BYTES else 4
    granule = max(4096, 1 << max(0, nbytes.bit_length() - shift))
    return -(-nbytes // granule) * granule


# Pinned buffers below ``EXACT_PIN_BYTES`` are carved from slabs that double from the first
# buffer's power of two up to this many bytes (a few KiB pin a few KiB).
SLAB_BYTES = 1 << 30
# Buffers of at least this many bytes are pinned alone at their size class: pageable memory
# page-locked in place (``cudaHostRegister``), which is not rounded. Carved from power-of-two
# slabs, a long batch's hidden-sized tensors at a length that is no power of two left a quarter
# of a slab unused each (Llama-3-8B at 49,152 tokens: 1.28x the swapped bytes pinned, and the
# host ran out under a plan that counted the bytes swapped).
EXACT_PIN_BYTES = 64 << 20
# An idle buffer of up to this many times a request's size class serves it when none of its own
# class is idle (``HostBufferPool.acquire``).
REUSE_LARGER = 2
# New host buffers stop, with a ``HostMemoryError``, where they would leave less host memory
# available than this: a clear error rather than the kernel's out-of-memory kill.
HOST_FLOOR_BYTES = 2 << 30


def _host_register(data: torch.Tensor) -> None:
    """Page-lock ``data`` (a pageable CPU tensor, just allocated) for asynchronous copies.

    Its pages are faulted in first by a fill on torch's intra-op threads: ``cudaHostRegister``
    faults the pages it finds missing on its one thread (H200 host, 16 cores: 2.4-3.2 GiB/s
    alone, 8.5 GiB/s after the fill; a long batch's first planned step pins ~80 GiB)."""
    data.zero_()
    error = int(torch.cuda.cudart().cudaHostRegister(data.data_ptr(), data.numel(), 0))
    if error != 0:
        raise RuntimeError(f"cudaHostRegister of {data.numel()} bytes failed: CUDA error {error}")


def _unlock_when_idle(data: torch.Tensor) -> None:
    """When a page-locked buffer goes: unlock it once the device is done with it (no copy may
    still read or write memory that is unlocked, then freed)."""
    try:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(data.data_ptr())
    except Exception:  # noqa: BLE001 - the interpreter shutting down: the process frees it all
        pass


def _check_host_room(nbytes: int, held: int) -> None:
    """Raise ``HostMemoryError`` if pinning ``nbytes`` more would leave the host less than
    ``HOST_FLOOR_BYTES`` available (``held``: bytes the pool holds already)."""
    from autooffload.runtime.chunks.host import host_memory

    memory = host_memory()
    if memory is None or memory.available_bytes - nbytes >= HOST_FLOOR_BYTES:
        return
    gib = 1 << 30
    raise HostMemoryError(
        f"autooffload: pinning {nbytes / gib:.2f} GiB more host memory for activations (held:"
        f" {held / gib:.2f} GiB) would leave {(memory.available_bytes - nbytes) / gib:.2f} GiB"
        " of the host's memory available; set AUTOOFFLOAD_N_SWAP lower (fewer blocks' saved"
        " tensors on the host), or free host memory"
    )


class _Slab:
    """One pinned allocation, a power of two bytes (what torch's pinned allocator gives any
    request: it rounds up to the next power of two), carved into buffers front to back."""

    __slots__ = ("data", "used", "buffers")

    def __init__(self, nbytes: int, pin_memory: bool) -> None:
        self.data = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin_memory)
        self.used = 0
        self.buffers = 0  # buffers carved from it that the pool still holds

    def carve(self, nbytes: int) -> torch.Tensor | None:
        if self.used + nbytes > self.data.numel():
            return None
        view = self.data[self.used : self.used + nbytes]
        self.used += nbytes
        self.buffers += 1
        return view


class _HostBuffer:
    __slots__ = ("data", "size_class", "ready", "slab", "registered", "__weakref__")

    def __init__(
        self, data: torch.Tensor, size_class: int, slab: _Slab | None = None,
        registered: bool = False,
    ) -> None:  # fmt: skip
        self.data = data
        self.size_class = size_class
        self.ready: torch.cuda.Event | None = None  # last H2D read; the next D2H waits for it
        self.slab = slab
        self.registered = registered  # page-locked alone (``EXACT_PIN_BYTES``)


class HostBufferPool:
    """Host buffers (pinned when ``pin_memory``) keyed by size class and reused across steps.

    A pinned buffer of ``EXACT_PIN_BYTES`` or more is pinned alone at its size class. Smaller
    ones are views of power-of-two slabs, filled first fit, since torch's pinned allocator would
    round each buffer up to a power of two on its own: a buffer within 1/8 of a power of two
    gets that power of two (its tail serves smaller buffers), the others share slabs each twice
    the last, up to ``SLAB_BYTES``. ``allocated_bytes`` counts what is pinned: the memory
    really held. A new pinned buffer that would leave the host less than ``HOST_FLOOR_BYTES``
    available raises ``HostMemoryError``."""

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self._idle: dict[int, list[_HostBuffer]] = defaultdict(list)
        self._slabs: list[_Slab] = []
        self._shared = 0  # bytes of the last slab made to be shared by buffers
        self._lock = threading.Lock()
        self.allocations = 0
        self.allocated_bytes = 0
        self.reuses = 0
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0

    def acquire(self, nbytes: int) -> _HostBuffer:
        """A buffer of at least ``nbytes``: an idle one of the same size class, else the smallest
        idle one of at most ``REUSE_LARGER`` times that class, else a new one. A step of a fixed
        shape finds its own classes idle again; a shorter batch than earlier ones reuses their
        buffers instead of pinning more (with batches of varied lengths, each length's classes
        kept the pool growing)."""
        size_class = _size_class(nbytes)
        with self._lock:
            idle = self._idle[size_class] or self._larger_idle(size_class)
            if idle:
                buffer = idle.pop()
                self.reuses += 1
            else:
                buffer = self._new_buffer(size_class)
                self.allocations += 1
            self.in_use_bytes += buffer.size_class
            self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return buffer

    def _larger_idle(self, size_class: int) -> list[_HostBuffer]:
        larger = [c for c, idle in self._idle.items() if idle and size_class < c]
        fits = [c for c in larger if c <= REUSE_LARGER * size_class]
        return self._idle[min(fits)] if fits else []

    def _new_buffer(self, size_class: int) -> _HostBuffer:
        if not self.pin_memory:  # pageable memory is not rounded: one allocation per buffer
            self.allocated_bytes += size_class
            return _HostBuffer(torch.empty(size_class, dtype=torch.uint8), size_class)
        if size_class >= EXACT_PIN_BYTES:
            _check_host_room(size_class, self.allocated_bytes)
            data = torch.empty(size_class, dtype=torch.uint8)
            _host_register(data)
            self.allocated_bytes += size_class
            buffer = _HostBuffer(data, size_class, registered=True)
            weakref.finalize(buffer, _unlock_when_idle, data)
            return buffer
        for slab in self._slabs:
            view = slab.carve(size_class)
            if view is not None:
                return _HostBuffer(view, size_class, slab)
        own = 1 << (size_class - 1).bit_length()
        if 8 * size_class >= 7 * own:
            nbytes = own  # rounding it alone wastes little; its tail serves smaller buffers
        else:
            self._shared = max(own, min(SLAB_BYTES, 2 * self._shared))
            nbytes = self._shared
        _check_host_room(nbytes, self.allocated_bytes)
        slab = _Slab(nbytes, pin_memory=True)
        self._slabs.append(slab)
        self.allocated_bytes += slab.data.numel()
        view = slab.carve(size_class)
        assert view is not None
        return _HostBuffer(view, size_class, slab)

    def release(self, buffer: _HostBuffer) -> None:
        """Give ``buffer`` back for reuse."""
        with self._lock:
            self.in_use_bytes -= buffer.size_class
            self._idle[buffer.size_class].append(buffer)

    def clear(self) -> None:
        """Free every idle buffer, and every slab none of whose buffers is in use (buffers in use
        are freed when released and dropped)."""
        with self._lock:
            for buffer in (b for buffers in self._idle.values() for b in buffers):
                if buffer.slab is None:  # a page-locked one is unlocked as it goes
                    self.allocated_bytes -= buffer.size_class
                else:
                    buffer.slab.buffers -= 1
            self._idle.clear()
            for slab in self._slabs:
                if slab.buffers == 0:
                    self.allocated_bytes -= slab.data.numel()
            self._slabs = [slab for slab in self._slabs if slab.buffers > 0]

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
        "compute_stream", "h2d_stream", "d2h_event", "h2d_event", "device_copy", "consumed",
        "__weakref__",
    )  # fmt: skip

    def __init__(
        self, pool: HostBufferPool, buffer: _HostBuffer, host: torch.Tensor, block_index: int,
        t: torch.Tensor,
    ) -> None:  # fmt: skip
        self.pool, self.buffer, self.host, self.block_index = pool, buffer, host, block_index
        self.size, self.stride, self.dtype, self.device = t.shape, host.stride(), t.dtype, t.device
        self.compute_stream: torch.cuda.Stream | None = None
        self.h2d_stream: torch.cuda.Stream | None = None
        self.d2h_event: torch.cuda.Event | None = None
        self.h2d_event: torch.cuda.Event | None = None
        self.device_copy: torch.Tensor | None = None
        self.consumed = False

    def __del__(self) -> None:
        if self.device_copy is not None and not self.consumed and self.h2d_stream is not None:
            # Prefetched but never unpacked (a backward cut short): no compute-stream work waited
            # for the H2D that writes the copy, so its memory may be neither reused nor unmapped
            # by an empty_cache (an illegal address) before the copy stream has passed it.
            self.device_copy.record_stream(self.h2d_stream)
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

    def forget(self) -> None:
        """After an interrupted forward or backward: drop the index of swapped tensors.

        A forward cut short by an exception leaves its partial graph, and so its swapped
        tensors, alive as long as the traceback is: an OOM retry runs inside the handler. Left
        indexed, the next backward would prefetch them beside its own (512 MiB per attention
        matrix in the OOM test on a GPU). A graph still alive unpacks its tensors on demand.
        """
        self.release_in_flight()
        self._records.clear()
        self._saved.clear()
        self._in_backward = False
        self._last_forward_index = -1
        self._unpacking_index = None

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
            # Not ``record_stream``-ed here: the unpack makes the compute stream wait for this
            # copy, so once used the copy is freed in compute-stream order like any tensor. Held
            # for the copy stream, its memory waited for every later prefetch queued there (the
            # next block's): 8B LoRA at 32K tokens kept 3.4 GiB of used copies unusable at the
            # peak and the allocator retried at every block. A copy never used is
            # ``record_stream``-ed when its record dies (``_Swapped.__del__``).
            record.h2d_stream = self.h2d_stream
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
