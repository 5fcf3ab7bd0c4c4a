"""The chunk store: chunk storage on host and GPU, the copy streams, events and residency.

Protocol, in plain words. Every chunk has one GPU byte tensor (``gpu_flat``) for its whole life;
its parameters' ``.data`` are views into it, created once at attach. A non-persistent chunk's
GPU storage is resized to 0 bytes while the chunk lives on the host and resized back when it is
gathered, exactly as FSDP frees unsharded parameters: views saved by autograd (e.g. ``weight.t()``
saved by a matmul) keep pointing at the same storage, which holds the right bytes again by the
time backward reads them. Copies run on side streams: ``h2d_stream`` fills a chunk and records
its ``ready`` event, which the compute stream waits on before the chunk's block runs. A sharded
chunk (``runtime/parallel/sharding.py``) is copied in by its owner and broadcast to the other
ranks; its ready event is recorded on ``gather_stream`` after the broadcast, so the H2D stream
goes on to the next chunk's copy meanwhile. The gradients leave through the store's ``grads``
(``GradientOffload``, on its own copy stream).

A chunk's device storage is allocated on the compute stream, not on the copy stream, and the
copy stream waits for the compute work queued before the allocation (``chunk_pool="compute"``,
the default; ``"copy"`` keeps the older behaviour, for comparison). The caching allocator keeps
one pool per stream (one expandable segment each), and memory freed in one pool cannot serve
another until the cache is emptied: with chunks in the copy stream's pool and activations in the
compute stream's, the reserved total was the sum of the two pools' peaks, not the peak of their
sum, and under a tight cap the allocator emptied its cache (a device synchronisation and a
remap) several times per step: 3.4 per step at 8B LoRA under 8 GiB. In one pool, a chunk freed
after its block is reused at once by the next chunk or by activations, in stream order, with no
``record_stream`` delay. In steady state the wait should cost no overlap (a prefetch is queued
before the block it overlaps, so it waits only for the blocks before that one, whose buffers it
reuses anyway), but an earlier one-pool experiment measured 13-21% slower steps for full
fine-tuning and Qwen2-VL LoRA, not re-measured since (docs/planner.md, "Pools").
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from autooffload.runtime.chunks.grad_offload import GradientOffload
from autooffload.runtime.chunks.host import HostArena
from autooffload.runtime.chunks.layout import Chunk, ChunkLayout, ParamSlot, slot_view
from autooffload.runtime.chunks.transfers import ChunkFutures, CopyStats

if TYPE_CHECKING:
    from autooffload.runtime.parallel.sharding import Sharding


class Residency(enum.Enum):
    HOST = "host"
    IN_FLIGHT = "in_flight"
    RESIDENT = "resident"


def _watch(
    table: dict[int, list[weakref.ref]], index: int, tensor: torch.Tensor, n_slots: int
) -> None:
    """Remember ``tensor`` as an alias of chunk ``index``'s bytes in ``table``. A chunk whose
    bytes never change (frozen weights) is never popped: the dead references are dropped here,
    or a state_dict() per step would pile them up."""
    refs = table.setdefault(index, [])
    if len(refs) >= 2 * n_slots:
        refs[:] = [ref for ref in refs if ref() is not None]
    refs.append(weakref.ref(tensor))


def _copy_out(table: dict[int, list[weakref.ref]], index: int) -> None:
    """Give every live alias of chunk ``index`` in ``table`` a private copy of its bytes."""
    for ref in table.pop(index, None) or ():
        tensor = ref()
        if tensor is not None:
            tensor.data = tensor.data.clone()


class ChunkManager:
    """Gathers, releases and prefetches the chunks of one model; its gradients go out through
    ``grads`` (``GradientOffload``)."""

    def __init__(
        self,
        layout: ChunkLayout,
        device: torch.device,
        persistent: Sequence[int],
        n_buffer: int,
        pin_memory: bool,
        sharding: Sharding | None = None,
        chunk_pool: str = "compute",
    ) -> None:
        self.layout = layout
        self.chunk_pool = chunk_pool
        self.chunks = layout.chunks
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.persistent = set(persistent)
        self.n_buffer = max(1, n_buffer)
        # Sharded CPU optimizer state (runtime/parallel/sharding.py): chunks other ranks own get
        # their weights by broadcast and send their gradients by reduce; this rank keeps neither
        # their host bytes nor their gradient staging.
        self.sharding = sharding
        self.host = HostArena(
            [c.nbytes if self.hosts(c.index) else 0 for c in self.chunks],
            pin=pin_memory and self.is_cuda,
        )
        # Bytes and seconds of copies and stalls, this store's and its gradients'.
        self.stats = CopyStats()
        self.grads = GradientOffload(
            self.chunks,
            device,
            sharding,
            pin_memory,
            self.stats,
            is_persistent=self.is_persistent,
            is_sharded=self.is_sharded,
        )
        self.state = [Residency.HOST] * len(self.chunks)
        self.gpu_flat: list[torch.Tensor] = []
        self.ready_events: list[torch.cuda.Event | None] = [None] * len(self.chunks)
        # CPU-side work that reads or writes a chunk's host bytes (optimizer updates); a copy
        # that touches those bytes waits for it first. Gradient accumulation touches the host
        # gradients and staging only (``grads.staging_busy``, ``GradStaging.grads_busy``): the
        # next micro-batch's forward gathers the weights without waiting for it.
        self.host_busy = ChunkFutures(len(self.chunks), self.stats)
        # Weak references to host-byte aliases handed out (state dicts), per chunk index.
        self._aliases: dict[int, list[weakref.ref]] = {}
        # The same for persistent chunks' device bytes (``device_alias``).
        self._device_aliases: dict[int, list[weakref.ref]] = {}
        # Hold counts of chunks whose release waits for the last ``unhold`` (code reading a
        # group's weights after the group's own forward returned: DoRA around a base layer).
        self.held: dict[int, int] = {}
        self._deferred_release: set[int] = set()
        if self.is_cuda:
            self.h2d_stream = torch.cuda.Stream(device)
            # Waits for sharded chunks' broadcasts and records their ready events, so that the
            # H2D stream is free for the next chunk's copy while a broadcast runs: chunks of
            # different owners are then copied in at the same time on their owners.
            self.gather_stream = torch.cuda.Stream(device) if sharding is not None else None
        # Device bytes of every chunk copy-in started (gathers and prefetches), for the
        # profiler to tell chunk storage from activations inside a window.
        self.copied_in_bytes = 0

    # ---- setup / teardown -------------------------------------------------------------------

    def hosts(self, index: int) -> bool:
        """Whether this rank keeps chunk ``index``'s bytes in its host store: every chunk, except
        under sharding a chunk another rank owns (its owner's copy is the only one)."""
        return self.sharding is None or self.sharding.hosts(index)

    def adopt_params(self, sync: Callable[[torch.Tensor], None] | None = None) -> None:
        """Move every parameter's bytes into the host store (or straight to the device, for a
        persistent chunk this rank does not host), then point it at its GPU chunk. ``sync``:
        called on each chunk's packed bytes before they are stored (data parallelism: every
        rank takes rank 0's, as DDP does when it wraps a model)."""
        for chunk in self.chunks:
            if self.hosts(chunk.index):
                host = self.host.view(chunk.index)
            else:
                host = torch.empty(chunk.nbytes, dtype=torch.uint8)
            for slot in chunk.slots:
                slot_view(host, slot).copy_(slot.param.data)
            if sync is not None:
                sync(host)
            flat = torch.empty(chunk.nbytes, dtype=torch.uint8, device=self.device)
            for slot in chunk.slots:
                slot.param.data = slot_view(flat, slot)
            self.gpu_flat.append(flat)
            if chunk.index in self.persistent:
                flat.copy_(host)
                self.state[chunk.index] = Residency.RESIDENT
            else:
                flat.untyped_storage().resize_(0)

    def host_view(self, slot: ParamSlot, chunk: Chunk) -> torch.Tensor:
        """The parameter's compute copy in the host store (a chunk this rank hosts)."""
        return slot_view(self._hosted(chunk.index), slot)

    def _hosted(self, index: int) -> torch.Tensor:
        if not self.hosts(index):
            raise RuntimeError(
                f"autooffload internal error: chunk {index} is hosted by rank"
                f" {self.sharding.owner(index)} only"  # type: ignore[union-attr]
            )
        return self.host.view(index)

    def host_alias(self, slot: ParamSlot, chunk: Chunk) -> torch.Tensor:
        """The parameter's host bytes as a tensor of its own storage, copied on write: before
        the runtime next writes the chunk's host bytes (an update, a load, a write-back),
        ``before_host_write`` gives every alias still alive a private copy, so an alias keeps
        the values it had when taken and costs no memory unless it outlives them."""
        if not self.hosts(chunk.index):
            # Another rank's chunk: the consolidated copy (never written, so no watch).
            return self.sharding.weight_alias(chunk.index, slot)  # type: ignore[union-attr]
        alias = self.host.alias(chunk.index, slot.offset, slot.nbytes, slot.dtype, slot.shape)
        self.watch_alias(chunk.index, alias)
        return alias

    def device_alias(self, slot: ParamSlot, chunk: Chunk) -> torch.Tensor:
        """A persistent parameter's device bytes as a tensor of its own storage, no copy.

        A view into the chunk would carry the chunk's whole storage, and storage-identity checks
        then take every parameter of the chunk for one tensor: accelerate's ``save_state``
        (``clean_state_dict_for_safetensors``) keeps one name per storage and drops the others
        from the file. Like torch's own state-dict entries the alias follows the parameter's
        updates; before the chunk's device memory is freed (a re-plan that offloads it, detach)
        ``_copy_out_device_aliases`` gives every live alias a private copy."""
        flat = self.gpu_flat[chunk.index]
        if slot.nbytes == 0:
            return torch.empty(slot.shape, dtype=slot.dtype, device=flat.device)
        storage = torch._C._construct_storage_from_data_pointer(
            flat.data_ptr() + slot.offset, flat.device, slot.nbytes
        )
        alias = torch.empty(0, dtype=slot.dtype, device=flat.device).set_(storage, 0, slot.shape)
        _watch(self._device_aliases, index=chunk.index, tensor=alias, n_slots=len(chunk.slots))
        return alias

    def _copy_out_device_aliases(self, index: int) -> None:
        """Give live ``device_alias`` tensors of chunk ``index`` their own memory before the
        chunk's device storage is freed (the aliases do not own it)."""
        _copy_out(self._device_aliases, index)

    def host_for_write(self, index: int) -> torch.Tensor:
        """Chunk ``index``'s host bytes, for a caller about to write them."""
        self.before_host_write(index)
        return self._hosted(index)

    def watch_alias(self, index: int, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` out of chunk ``index``'s host bytes before they are next written."""
        _watch(self._aliases, index=index, tensor=tensor, n_slots=len(self.chunks[index].slots))

    def before_host_write(self, index: int) -> None:
        """Called before chunk ``index``'s host bytes change: detach live aliases of them."""
        if self._aliases:
            _copy_out(self._aliases, index)

    def set_persistent(self, persistent: Sequence[int], n_buffer: int) -> None:
        """Change which chunks stay on the GPU (a re-plan); moves bytes as needed."""
        self.synchronize()
        new = set(persistent)
        for index in sorted(self.persistent - new):
            self._write_back(index)
            self.persistent.discard(index)
            self.release(index)
        for index in sorted(new - self.persistent):
            # Gathered while still offloaded: a sharded chunk comes from its owner's bytes.
            self.host_busy.wait(index)
            if self.state[index] != Residency.RESIDENT:
                self.gather(index)
            self.persistent.add(index)
        self.n_buffer = max(1, n_buffer)

    def _write_back(self, index: int) -> None:
        """Copy a resident chunk's GPU bytes to the host store (persistent chunks are updated
        on the GPU, so their host copy is stale until written back). A chunk this rank does
        not host is written back by its owner (replicas of a persistent chunk are equal)."""
        if self.state[index] == Residency.RESIDENT and self.hosts(index):
            self.before_host_write(index)
            self.host.view(index).copy_(self.gpu_flat[index])

    def materialize(
        self, device: torch.device, fetched: dict[int, torch.Tensor] | None = None
    ) -> None:
        """Detach: give every parameter an ordinary tensor on ``device`` with its current bytes
        (``fetched``: the bytes of offloaded chunks this rank does not host, by index)."""
        self.synchronize()
        for chunk in self.chunks:
            if chunk.index in self.persistent:
                source = self.gpu_flat[chunk.index]
            elif fetched and chunk.index in fetched:
                source = fetched[chunk.index]
            else:
                source = self.host.view(chunk.index)
            for slot in chunk.slots:
                slot.param.data = slot_view(source, slot).to(device, copy=True)
        for index in list(self._aliases):
            self.before_host_write(index)  # an alias would keep the whole arena alive
        for index in list(self._device_aliases):
            self._copy_out_device_aliases(index)
        self.gpu_flat = []
        self.host.free()
        self.grads.free()

    # ---- residency ----------------------------------------------------------------------------

    def n_in_use(self) -> int:
        return sum(
            1 for i, s in enumerate(self.state) if s != Residency.HOST and i not in self.persistent
        )

    def is_persistent(self, index: int) -> bool:
        """Whether chunk ``index`` stays on the device (the plan's persistent chunks)."""
        return index in self.persistent

    def is_sharded(self, index: int) -> bool:
        """Whether chunk ``index`` comes from its owning rank (runtime/parallel/sharding.py)."""
        return self.sharding is not None and self.sharding.applies(index, self.persistent)

    def _start_copy_in(self, index: int) -> None:
        """Start filling chunk ``index``'s device storage on the H2D stream. A sharded chunk
        (``runtime/parallel/sharding.py``) is copied in by its owner alone, then broadcast to the
        rest."""
        chunk = self.chunks[index]
        flat = self.gpu_flat[index]
        sharded = self.is_sharded(index)
        local = not sharded or self.sharding.owns(index)  # type: ignore[union-attr]
        if local:
            self.host_busy.wait(index)
        if self.is_cuda:
            if self.chunk_pool == "compute":
                # Allocated in the compute stream's pool (see the module docstring): the copy
                # may write only once the compute queued so far is done with the memory.
                flat.untyped_storage().resize_(chunk.nbytes)
                self.h2d_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.h2d_stream):
                if self.chunk_pool == "copy":
                    flat.untyped_storage().resize_(chunk.nbytes)
                start = torch.cuda.Event(enable_timing=True)
                start.record(self.h2d_stream)
                if local:
                    flat.copy_(self.host.view(index), non_blocking=True)
                    copied = torch.cuda.Event(enable_timing=True)
                    copied.record(self.h2d_stream)
                    self.stats.time("h2d_s", start, copied)
                # The collective waits for the work queued on this stream: the owner's copy.
                work = self.sharding.broadcast(flat, index) if sharded else None  # type: ignore[union-attr]
            if work is None:
                event = copied
            else:
                # Compute waits for the collective through the ready event; the H2D stream
                # does not, and goes on to the next chunk's copy.
                with torch.cuda.stream(self.gather_stream):
                    work.wait()
                    event = torch.cuda.Event(enable_timing=True)
                    event.record(self.gather_stream)
                self.stats.time("gather_s", start, event)
            self.ready_events[index] = event
        else:
            flat.untyped_storage().resize_(chunk.nbytes)
            if local:
                flat.copy_(self.host.view(index))
            if sharded:
                self.sharding.broadcast(flat, index).wait()  # type: ignore[union-attr]
        self.state[index] = Residency.IN_FLIGHT
        self.copied_in_bytes += chunk.nbytes
        if local:
            self.stats["h2d_bytes"] += chunk.nbytes
        if sharded:
            self.stats["broadcast_bytes"] += chunk.nbytes
        self.stats["gathers"] += 1

    def gather(self, index: int) -> None:
        """Make chunk ``index`` usable by work queued next on the current stream."""
        if self.state[index] == Residency.RESIDENT:
            return
        if self.state[index] == Residency.HOST:
            self._start_copy_in(index)
        event = self.ready_events[index]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
            self.ready_events[index] = None
        self.state[index] = Residency.RESIDENT

    def prefetch(self, index: int) -> bool:
        """Start copying chunk ``index`` in if a buffer is free and its host bytes are ready."""
        if self.state[index] != Residency.HOST or index in self.persistent:
            return False
        if self.n_in_use() >= self.n_buffer:
            return False
        busy = self.host_busy.get(index)
        # A sharded chunk's prefetch is a collective: every rank must decide alike, so it
        # waits for the owner's update rather than depend on CPU timing.
        if busy is not None and not busy.done() and not self.is_sharded(index):
            return False
        self._start_copy_in(index)
        return True

    def release(self, index: int) -> None:
        """Free a non-persistent chunk's GPU memory once the work queued so far is done with it."""
        if index in self.persistent or self.state[index] == Residency.HOST:
            return
        if index in self.held:
            self._deferred_release.add(index)
            return
        flat = self.gpu_flat[index]
        if self.is_cuda:
            current = torch.cuda.current_stream(self.device)
            in_flight = self.state[index] == Residency.IN_FLIGHT
            ready = self.ready_events[index]
            if in_flight and ready is not None:
                # Work queued next on the stream whose pool it returns to may reuse the memory,
                # so that stream waits for the copy (or broadcast) still writing it.
                stream = current if self.chunk_pool == "compute" else self.h2d_stream
                stream.wait_event(ready)
            if not in_flight:
                # A no-op on the stream that allocated it (the compute stream's pool); from the
                # copy stream's pool, or after a user's side stream read it, reuse waits until
                # the compute that read it is done.
                flat.record_stream(current)
        if self._device_aliases:
            self._copy_out_device_aliases(index)
        flat.untyped_storage().resize_(0)
        self.ready_events[index] = None
        self.state[index] = Residency.HOST

    def hold(self, index: int) -> None:
        """Defer every ``release`` of chunk ``index`` until as many ``unhold`` calls."""
        self.held[index] = self.held.get(index, 0) + 1

    def unhold(self, index: int) -> None:
        """End one ``hold``; the last one performs a release requested meanwhile."""
        count = self.held.pop(index, 0) - 1
        if count > 0:
            self.held[index] = count
        elif index in self._deferred_release:
            self._deferred_release.discard(index)
            self.release(index)

    def resident_bytes(self) -> int:
        """Bytes of chunk storage on the device now (persistent and in-use buffers)."""
        return sum(self.chunks[i].nbytes for i, s in enumerate(self.state) if s != Residency.HOST)

    def release_all(self) -> None:
        for index in range(len(self.chunks)):
            self.release(index)

    def fold_copy_times(self, wait: bool = False) -> None:
        """Add the measured durations of finished copies to ``stats`` (all of them if ``wait``)."""
        self.stats.fold(wait)

    def synchronize(self) -> None:
        """Wait for every copy and every CPU task that touches chunk bytes."""
        self.host_busy.wait_all()
        self.grads.synchronize()
        if self.is_cuda:
            self.h2d_stream.synchronize()
            if self.gather_stream is not None:
                self.gather_stream.synchronize()
