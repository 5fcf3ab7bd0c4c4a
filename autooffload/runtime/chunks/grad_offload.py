"""Gradient offload: chunks' gradients out to pinned host staging, averaged across ranks first
under data parallelism, and handed to the optimizer side.

An offloaded chunk's gradients leave the device as its backward completes: norms for clipping
are taken on the device, then a copy on ``d2h_stream`` fills the chunk's pinned staging and
records the event the CPU optimizer's worker waits on (``connect_update``). Under gradient
accumulation on the GPU the running sum held in the staging is added to them on a side stream
first. Under data parallelism every rank reduces the same chunks in one order (rank 0's forward
order), each once per backward: a persistent chunk in place, an offloaded one into its staging.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from autooffload.plan.cost_memory import ACCUMULATE_SCRATCH_BYTES
from autooffload.runtime.chunks.host import HostArena
from autooffload.runtime.chunks.layout import ALIGN, Chunk, ParamSlot, slot_view
from autooffload.runtime.chunks.transfers import ChunkFutures, CopyStats

if TYPE_CHECKING:
    from autooffload.runtime.parallel.distributed import DataParallel, Reduction
    from autooffload.runtime.parallel.sharding import Sharding


GradsReady = Callable[
    [
        Chunk,
        list[ParamSlot],
        "torch.cuda.Event | None",
        "tuple[torch.Tensor, ...]",
        "torch.Tensor | None",
        bool,
    ],
    None,
]
# Gradient accumulation on the GPU (``GradientOffload._sum_on_device``): the running sums come back
# through a device scratch of this many bytes, piece by piece (the planner's
# ``cost_memory.ACCUMULATE_SCRATCH_BYTES``).
SUM_SCRATCH_BYTES = ACCUMULATE_SCRATCH_BYTES


class GradientOffload:
    """The gradient side of the chunk store: staging, device sums and data-parallel reduction.

    ``is_persistent`` and ``is_sharded`` answer for the store, whose residency they read: a
    persistent chunk's gradients are averaged in place, a sharded one's reduced to its owner.
    """

    def __init__(
        self,
        chunks: list[Chunk],
        device: torch.device,
        sharding: Sharding | None,
        pin_memory: bool,
        stats: CopyStats,
        is_persistent: Callable[[int], bool],
        is_sharded: Callable[[int], bool],
    ) -> None:
        self.chunks = chunks
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.sharding = sharding
        self.stats = stats
        self.is_persistent = is_persistent
        self.is_sharded = is_sharded
        self._staging_offsets: dict[int, int] = {}
        staging_sizes = []
        for chunk in chunks:
            size = 0
            if sharding is not None and not sharding.owns(chunk.index):
                staging_sizes.append(0)
                continue
            for slot in chunk.trainable_slots:
                self._staging_offsets[id(slot.param)] = size
                size += (slot.nbytes + ALIGN - 1) // ALIGN * ALIGN
            staging_sizes.append(size)
        # Allocated at the first gradient offloaded: a model used under no_grad only (a DPO
        # reference loaded with its params requiring grad) never pins it.
        self.staging = HostArena(staging_sizes, pin=pin_memory and self.is_cuda, lazy=True)
        # The CPU work reading a chunk's staging (gradient accumulation, updates).
        self.staging_busy = ChunkFutures(len(chunks), stats)
        if self.is_cuda:
            self.d2h_stream = torch.cuda.Stream(device)
        self._on_grads_ready: GradsReady | None = None
        # Data parallel, sharded state, the owner: a chunk's gradients are being averaged into
        # the views given, its weights resident; True where the callee updates it on the
        # device (``BackwardUpdates.update_averaged_on_device``), else they go to the host.
        self._on_grads_averaging: Callable[[Chunk, list[torch.Tensor], Reduction], bool] | None = (
            None
        )
        # Called with a chunk's index before its staging is written again (the CPU optimizer
        # may have aliased its host gradients to it and must release them first).
        self._before_staging_write: Callable[[int], None] | None = None
        # Gradient accumulation on the GPU (``GradStaging.device_sums``): per slot of the
        # gradients going out, whether the staging holds a running sum to add them to on the
        # device first; None where the CPU accumulates them.
        self._device_sums: Callable[[Chunk, list[ParamSlot]], list[bool] | None] | None = None
        self._sum_stream: torch.cuda.Stream | None = None
        self._sum_scratch: torch.Tensor | None = None
        # Data parallelism (runtime/parallel/distributed.py): the reducer, and per chunk the
        # backward pass whose gradients it last reduced (each chunk is reduced once per backward).
        self.data_parallel: DataParallel | None = None
        self._reduced: dict[int, int] = {}
        # Data parallel: the order every rank reduces chunk gradients in (``set_reduce_order``).
        self.reduce_order: list[int] | None = None
        self._order_next = 0
        self._ready_to_reduce: set[int] = set()
        # Persistent chunks with a slot this rank has no gradient for, and the averaged
        # presence of each slot's gradient across ranks (``drop_grads_unused_everywhere``).
        self._presence_pending: list[tuple[list[ParamSlot], torch.Tensor]] = []
        # Pinned host copies of offloaded chunks' averaged presence, per chunk index.
        self._presence_host: dict[int, torch.Tensor] = {}
        self._backward_id = 0

    def connect_update(
        self,
        grads_ready: GradsReady | None,
        grads_averaging: Callable[[Chunk, list[torch.Tensor], Reduction], bool] | None,
        before_staging_write: Callable[[int], None] | None,
        device_sums: Callable[[Chunk, list[ParamSlot]], list[bool] | None] | None,
    ) -> None:
        """Wire the update side (the CPU optimizer) to the gradient events of this store; all
        None disconnects it (at detach, so nothing of it stays reachable from here)."""
        self._on_grads_ready = grads_ready
        self._on_grads_averaging = grads_averaging
        self._before_staging_write = before_staging_write
        self._device_sums = device_sums

    def set_data_parallel(self, data_parallel: DataParallel | None) -> None:
        """The reducer whose collectives average each chunk's gradients (None: one process)."""
        self.data_parallel = data_parallel

    def free(self) -> None:
        """Detach: the staging and the device sums' scratch go, and the store's callbacks (a
        cycle through the store that would keep its params alive until a cyclic gc)."""
        self._sum_scratch = None
        self.staging.free()
        del self.is_persistent, self.is_sharded

    def stages(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s gradients have a place in this rank's staging (trainable at
        attach, in a chunk this rank owns)."""
        return id(param) in self._staging_offsets

    def staging_view(self, slot: ParamSlot, chunk: Chunk) -> torch.Tensor:
        """The pinned host buffer the parameter's gradient is copied into."""
        return slot_view(
            self.staging.view(chunk.index), slot, self._staging_offsets[id(slot.param)]
        )

    def synchronize(self) -> None:
        """Wait for every gradient copy out and every CPU task reading the staging."""
        self.staging_busy.wait_all()
        if self.is_cuda:
            self.d2h_stream.synchronize()

    def offload_grads(self, index: int) -> None:
        """Copy the gradients of an offloaded chunk to pinned host staging and free them on GPU.

        The CPU optimizer side is told (``connect_update``'s ``grads_ready``) with the event to
        wait on. Under data parallelism the gradients are averaged across ranks first (a persistent
        chunk's in place, finished at the end of backward; see ``runtime/parallel/distributed.py``).
        """
        chunk = self.chunks[index]
        if self.data_parallel is not None and self.reduce_order is not None:
            self._reduce_in_order(index)
            return
        if self.data_parallel is not None or self.is_persistent(index):
            self._reduce(chunk)
            return
        slots = [s for s in chunk.trainable_slots if s.param.grad is not None]
        if not slots:
            return
        sums = self._device_sums(chunk, slots) if self._device_sums is not None else None
        if sums is None:
            # The staging bytes are reused each backward: whatever reads them must be done.
            self._claim_staging(index)
        else:
            # The staging holds the running sum, which stays there: its last reader first.
            self.staging_busy.wait(index)
        grads = [s.param.grad for s in slots]
        event = None
        if self.is_cuda:
            source = torch.cuda.current_stream(self.device)
            if sums is not None and any(sums):
                source = self._sum_on_device(chunk, slots, sums, source)
            with torch.cuda.stream(source):
                # Norms for gradient clipping, taken where they are nearly free: on the device,
                # before the copy (one fused kernel), instead of a pass over host memory.
                norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
            self.d2h_stream.wait_stream(source)
            with torch.cuda.stream(self.d2h_stream):
                start = torch.cuda.Event(enable_timing=True)
                start.record(self.d2h_stream)
                for slot in slots:
                    grad = slot.param.grad
                    self.staging_view(slot, chunk).copy_(grad, non_blocking=True)
                    grad.record_stream(self.d2h_stream)
                event = torch.cuda.Event(enable_timing=True)
                event.record(self.d2h_stream)
            self.stats.time("d2h_s", start, event)
        else:
            for slot, add in zip(slots, sums or [False] * len(slots), strict=True):
                if add:
                    slot.param.grad.add_(self.staging_view(slot, chunk))
                    self.stats["summed_params"] += slot.numel
            norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
            for slot in slots:
                self.staging_view(slot, chunk).copy_(slot.param.grad)
        self._grads_sent(chunk, slots, event, norms, summed=sums is not None)

    def _sum_on_device(
        self,
        chunk: Chunk,
        slots: list[ParamSlot],
        sums: list[bool],
        source: torch.cuda.Stream,
    ) -> torch.cuda.Stream:
        """Gradient accumulation on the GPU: add the running sums held in the staging to the
        gradients of ``slots`` (where ``sums`` says), in place, on a side stream after
        ``source``; returns it (the copy out waits for it). Each sum comes in through the
        scratch piece by piece, so the device needs ``SUM_SCRATCH_BYTES`` beside the
        gradients, not a second copy of them; the copy engine runs beside the compute."""
        if self._sum_stream is None:
            self._sum_stream = torch.cuda.Stream(self.device)
        stream = self._sum_stream
        stream.wait_stream(source)
        with torch.cuda.stream(stream):
            if self._sum_scratch is None:
                largest = max(s.nbytes for c in self.chunks for s in c.trainable_slots)
                size = min(SUM_SCRATCH_BYTES, (largest + ALIGN - 1) // ALIGN * ALIGN)
                self._sum_scratch = torch.empty(size, dtype=torch.uint8, device=self.device)
            for slot, add in zip(slots, sums, strict=True):
                if not add:
                    continue
                grad = slot.param.grad
                staged = self.staging_view(slot, chunk)
                if not grad.is_contiguous():
                    grad.add_(staged.to(self.device, non_blocking=True))
                else:
                    flat, flat_staged = grad.view(-1), staged.view(-1)
                    scratch = self._sum_scratch.view(slot.dtype)
                    piece = scratch.numel()
                    for start in range(0, flat.numel(), piece):
                        part = flat_staged[start : start + piece]
                        buffer = scratch[: part.numel()]
                        buffer.copy_(part, non_blocking=True)
                        flat[start : start + part.numel()].add_(buffer)
                self.stats["summed_params"] += slot.numel
                self.stats["sum_h2d_bytes"] += slot.nbytes
        return stream

    def _claim_staging(self, index: int) -> None:
        """Wait until chunk ``index``'s gradient staging may be overwritten."""
        if self._before_staging_write is not None:
            self._before_staging_write(index)
        self.staging_busy.wait(index)

    def _grads_sent(
        self,
        chunk: Chunk,
        slots: list[ParamSlot],
        event: torch.cuda.Event | None,
        norms: Sequence[torch.Tensor],
        presence: torch.Tensor | None = None,
        summed: bool = False,
    ) -> None:
        """``summed``: the staging now holds the sum of every backward since zero_grad (the
        GPU accumulated them: ``_sum_on_device``), nothing to add on the host."""
        for slot in slots:
            slot.param.grad = None
            self.stats["d2h_bytes"] += slot.nbytes
        if self._on_grads_ready is not None:
            self._on_grads_ready(chunk, slots, event, tuple(norms), presence, summed)

    def _presence(self, slots: list[ParamSlot], dtype: torch.dtype) -> torch.Tensor:
        """1 where this rank has a gradient for the slot, 0 where not: averaged with the
        gradients, it is 0 exactly for the slots no rank has a gradient for, which DDP leaves
        without one (and AdamW then neither decays nor moves)."""
        # Made on the device (no host-to-device copy, which would wait for the queued compute):
        # ones, and a zero per slot without a gradient (rare).
        presence = torch.ones(len(slots), dtype=dtype, device=self.device)
        for i, slot in enumerate(slots):
            if slot.param.grad is None:
                presence[i] = 0
        return presence

    def _presence_on_host(self, index: int, presence: torch.Tensor) -> torch.Tensor:
        """A reused host tensor (pinned on GPUs) that ``presence`` is copied into."""
        host = self._presence_host.get(index)
        if host is None or host.shape != presence.shape or host.dtype != presence.dtype:
            host = torch.empty(presence.shape, dtype=presence.dtype, pin_memory=presence.is_cuda)
            self._presence_host[index] = host
        return host

    def _reduce(self, chunk: Chunk) -> None:
        """Average ``chunk``'s gradients across ranks: in place for a persistent chunk, into
        host staging for an offloaded one (a persistent chunk on one rank: nothing to do)."""
        if self.is_persistent(chunk.index):
            self._reduce_persistent(chunk)
        else:
            self._offload_averaged_grads(chunk)

    def _offload_averaged_grads(self, chunk: Chunk) -> None:
        """``offload_grads`` under data parallelism: every trainable slot (zeros where this
        rank has no gradient, so all ranks reduce the same tensors), averaged across ranks,
        then norms and D2H copies on the D2H stream once the collective is done."""
        assert self.data_parallel is not None
        slots = list(chunk.trainable_slots)
        if not slots or self._reduced.get(chunk.index) == self._backward_id:
            return
        # Reduced even where this rank has no gradient (another may have): ranks issue the
        # same collectives; the presence flags keep params no rank had a gradient for as such.
        self._reduced[chunk.index] = self._backward_id
        self._claim_staging(chunk.index)
        local_missing = any(s.param.grad is None for s in slots)
        grads = [
            s.param.grad
            if s.param.grad is not None
            else torch.zeros(s.shape, dtype=s.dtype, device=self.device)
            for s in slots
        ]
        # Reduced with the gradients (same dtype: the same collective).
        grads.append(self._presence(slots, grads[0].dtype))
        sharded = self.is_sharded(chunk.index)
        reduction = self.data_parallel.start(
            grads, reduce=self.sharding.reduce if sharded else None, index=chunk.index
        )
        for slot in slots:
            slot.param.grad = None
        if sharded and not self.sharding.owns(chunk.index):
            self._drop_after(reduction)
            return
        views = reduction.views[:-1]
        if (
            sharded
            and not local_missing  # a parameter no rank had a gradient for keeps none: host
            and self._on_grads_averaging is not None
            and self._on_grads_averaging(chunk, views, reduction)
        ):
            return
        presence = self._presence_on_host(chunk.index, reduction.views[-1])
        event = None
        if self.is_cuda:
            self.d2h_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.d2h_stream):
                reduction.wait()
                norms = torch._foreach_norm(views, 2, dtype=torch.float32)
                start = torch.cuda.Event(enable_timing=True)
                start.record(self.d2h_stream)
                presence.copy_(reduction.views[-1], non_blocking=True)
                for slot, averaged in zip(slots, views, strict=True):
                    self.staging_view(slot, chunk).copy_(averaged, non_blocking=True)
                for flat in reduction.flats:
                    flat.record_stream(self.d2h_stream)
                event = torch.cuda.Event(enable_timing=True)
                event.record(self.d2h_stream)
            self.stats.time("d2h_s", start, event)
        else:
            reduction.wait()
            norms = torch._foreach_norm(views, 2, dtype=torch.float32)
            presence.copy_(reduction.views[-1])
            for slot, averaged in zip(slots, views, strict=True):
                self.staging_view(slot, chunk).copy_(averaged)
        self._grads_sent(chunk, slots, event, norms, presence)

    def _drop_after(self, reduction: Reduction) -> None:
        """A non-owner's part of a sharded chunk's gradient reduce: keep the buffers until the
        collective has read them, then let them go."""
        if self.is_cuda:
            self.d2h_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.d2h_stream):
                reduction.wait()
                for flat in reduction.flats:
                    flat.record_stream(self.d2h_stream)
        else:
            reduction.wait()

    def _reduce_persistent(self, chunk: Chunk) -> None:
        """Start averaging a persistent chunk's gradients across ranks (once per backward)."""
        dp = self.data_parallel
        if dp is None or not dp.sync or self._reduced.get(chunk.index) == self._backward_id:
            return
        slots = list(chunk.trainable_slots)
        if not slots:
            return
        self._reduced[chunk.index] = self._backward_id
        missing = any(slot.param.grad is None for slot in slots)
        presence = self._presence(slots, torch.float32)
        for slot in slots:
            if slot.param.grad is None:
                slot.param.grad = torch.zeros_like(slot.param)
        # Every rank reduces the presence flags (one small collective), so that ranks stay in
        # step; only one missing a gradient reads them (``drop_grads_unused_everywhere``).
        dp.reduce_in_place([s.param.grad for s in slots] + [presence])
        if missing:
            self._presence_pending.append((slots, presence))

    def drop_grads_unused_everywhere(self) -> None:
        """After the backward's reductions finished: persistent params no rank had a gradient
        for get none (``.grad = None``, as under DDP) instead of an average of zeros."""
        pending, self._presence_pending = self._presence_pending, []
        for slots, presence in pending:
            for slot, present in zip(slots, presence.tolist(), strict=True):
                if present == 0:
                    slot.param.grad = None

    def reduced_in_this_backward(self, index: int) -> bool:
        """Whether chunk ``index``'s gradients were averaged across ranks in this backward."""
        return self._reduced.get(index) == self._backward_id

    def begin_backward(self, backward_id: int) -> None:
        """A new backward pass: every chunk's gradients may be reduced once again."""
        self._backward_id = backward_id
        self._order_next = 0
        self._ready_to_reduce = set()

    # ---- data parallel: one reduction order on every rank -----------------------------------

    def set_reduce_order(self, order: Sequence[int]) -> None:
        """Reduce the gradients of chunks ``order`` (every chunk with trainable params), in that
        order, in every backward. Ranks must issue their collectives in one order, and a rank
        on which some module did not run (a branch taken elsewhere) completes its chunks in
        another: a chunk ready early waits for those before it (DDP's buckets do the same)."""
        self.reduce_order = list(order)

    def _reduce_in_order(self, index: int) -> None:
        """Chunk ``index``'s gradients are complete here: reduce it, and the chunks after it
        that were waiting for it, as far as the order allows."""
        assert self.reduce_order is not None
        if not self.chunks[index].trainable_slots:
            return
        self._ready_to_reduce.add(index)
        order = self.reduce_order
        while self._order_next < len(order) and order[self._order_next] in self._ready_to_reduce:
            self._order_next += 1
            self._reduce(self.chunks[order[self._order_next - 1]])

    def flush_reductions(self) -> None:
        """The end of a backward: every chunk left in the order is complete; reduce them all."""
        if self.data_parallel is None or self.reduce_order is None:
            return
        for index in self.reduce_order[self._order_next :]:
            self._reduce_in_order(index)
