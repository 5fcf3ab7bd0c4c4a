"""Data parallelism over ``torch.distributed``: chunk-level gradient averaging across ranks.

Every rank attaches its own replica of the model with the same layout and plan. Gradients are
averaged with the process group's collectives (NCCL on GPUs, gloo in the CPU simulation), one
collective per chunk, issued the moment the chunk's backward is complete:

* an **offloaded** chunk's gradients are flattened (one buffer per dtype) and all-reduced
  asynchronously from the compute stream; the D2H stream waits for the collective, takes the
  clipping norms of the averaged gradients and copies them to host staging, so the reduction
  overlaps the rest of the backward and the CPU optimizer receives averaged gradients;
* a **persistent** chunk's gradients are all-reduced in place (one collective per tensor, no
  extra memory), resident adapters' flattened into one; the end of backward waits for them,
  so the user's optimizer reads averaged ``.grad`` tensors.

Plans are agreed: rank 0's searched plan is broadcast (profiles differ per rank; plans must
not, or the ranks would issue different collectives and hang). At attach, ranks compare
their layouts and settings and all raise the same error if they differ. ``no_sync`` (DDP's, or
:func:`autooffload.no_sync`) skips the reduction of persistent and resident gradients, which
accumulate locally and are averaged at the next synchronised backward; offloaded chunks are
reduced on every backward, since their gradients leave the GPU anyway.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from autooffload.errors import AttachError
from autooffload.log import logger
from autooffload.runtime import registry
from autooffload.runtime.parallel.affinity import bind_near_gpu

if TYPE_CHECKING:
    from autooffload.plan.profile_types import HardwareProfile
    from autooffload.plan.types import Plan
    from autooffload.runtime.chunks.layout import ChunkLayout
    from autooffload.runtime.runtime import Runtime
    from autooffload.settings import Settings

T = TypeVar("T")


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@dataclass
class Reduction:
    """One asynchronous gradient average: flat buffers per dtype and their views per tensor."""

    works: list[Any]
    flats: list[torch.Tensor]
    views: list[torch.Tensor]
    targets: list[torch.Tensor] = field(default_factory=list)

    def wait(self) -> None:
        """Make the current stream (or, on CPU, the caller) wait for the collectives."""
        for work in self.works:
            work.wait()


class DataParallel:
    """Gradient averaging of one attached model across the ranks of a process group."""

    def __init__(self, device: torch.device, group: Any = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        # NCCL reduces device tensors (with AVG); gloo (the CPU simulation) host ones.
        self.nccl = "nccl" in self.backend
        self.device = device
        # False inside no_sync: persistent and resident gradients accumulate locally.
        self._sync = True
        self._pending: list[Reduction] = []
        self.reduced_bytes = 0
        # Bytes/s of one chunk's gradient collective, and of the all-reduce of a persistent
        # chunk's gradients, measured at attach (``measure_gradient_collective``); read by the
        # planner's cost model.
        self.gradient_bps = float("inf")
        self.allreduce_bps = float("inf")

    @staticmethod
    def create(settings: Settings, device: torch.device) -> DataParallel | None:
        """The data-parallel reducer for this process, or None (no group, one rank, or off)."""
        if settings.data_parallel == "off":
            return None
        _, size = world()
        if size <= 1:
            return None
        return DataParallel(device)

    # ---- agreement ----------------------------------------------------------------------------

    def check_same(self, what: dict[str, Any]) -> None:
        """Raise the same ``AttachError`` on every rank if ``what`` differs between ranks."""
        mine = json.dumps(what, sort_keys=True, default=str)
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine, group=self.group)
        differing = sorted(
            key
            for key in what
            if len({json.dumps(json.loads(g)[key], default=str) for g in gathered}) > 1
        )
        if differing:
            values = {
                key: [json.loads(g)[key] for g in gathered] for key in differing[:3]
            }  # per rank
            raise AttachError(
                f"ranks disagree on {', '.join(differing)} (per rank: {values}); every rank must"
                " attach the same model with the same AUTOOFFLOAD_* settings (budget, chunk"
                " size, counts), or the ranks would issue different collectives and hang"
            )

    def agree(self, plan: Plan) -> Plan:
        """Rank 0's plan, on every rank."""
        agreed = self.agree_object(plan)
        assert agreed is not None
        if self.rank != 0 and agreed != plan:
            logger.debug("rank %d takes rank 0's plan: %s", self.rank, agreed.summary())
        return agreed

    def agree_object(self, value: T) -> T:
        """Rank 0's ``value`` (any picklable object, None included), on every rank."""
        box = [value if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=self.global_rank(0), group=self.group)
        return box[0]  # type: ignore[return-value]

    @property
    def sync(self) -> bool:
        """Whether the coming backward averages gradients (False inside ``no_sync``)."""
        return self._sync

    def set_sync(self, sync: bool) -> None:
        """Average the coming backward's gradients (``sync``) or let them accumulate locally
        (``no_sync``, DDP's ``require_backward_grad_sync``)."""
        self._sync = sync

    def gather_object(self, value: T) -> list[T]:
        """Every rank's ``value``, in rank order, on every rank."""
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def barrier(self) -> None:
        """Return once every rank of the group got here (a one-element all-reduce, read back:
        on NCCL the host waits for the collective, not only the stream)."""
        flag = torch.zeros(1, device=self.collective_device)
        dist.all_reduce(flag, group=self.group)
        flag.item()

    def global_rank(self, group_rank: int) -> int:
        """The global rank of ``group_rank`` in this data-parallel group."""
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def broadcast_(self, tensors: list[torch.Tensor]) -> None:
        """Overwrite ``tensors`` with rank 0's (weights at wrap time, as DDP does)."""
        for tensor in tensors:
            if self.nccl and tensor.device.type != "cuda":
                staged = tensor.to(self.device)
                dist.broadcast(staged, src=self.global_rank(0), group=self.group)
                tensor.copy_(staged)
            else:
                dist.broadcast(tensor, src=self.global_rank(0), group=self.group)

    def sync_replica(self, runtime: Runtime) -> None:
        """Make this rank's replica equal rank 0's: chunk bytes (host store, or device storage
        of persistent chunks), resident params and buffers (DDP does this when it wraps; the
        attach did it too). A sharded chunk has one copy, its owner's: nothing to sync."""
        runtime.synchronize()
        manager = runtime.manager
        manager.release_all()
        tensors = [
            manager.gpu_flat[chunk.index]
            if chunk.index in manager.persistent
            else manager.host_for_write(chunk.index)
            for chunk in manager.chunks
            if chunk.index in manager.persistent or not manager.is_sharded(chunk.index)
        ]
        tensors += [p.data for p in runtime.resident_params]
        tensors += [b for b in runtime.model.buffers() if b is not None]
        self.broadcast_(tensors)
        runtime.cpu_optim.refresh_masters()

    # ---- the cost model's view -----------------------------------------------------------------

    @property
    def collective_device(self) -> torch.device:
        """Where the backend's collectives take their tensors (the GPU for NCCL)."""
        return self.device if self.nccl else torch.device("cpu")

    def time_collective(self, once: Callable[[], None], repeats: int) -> float:
        """Seconds ``repeats`` calls of the collective ``once`` take on this rank, after one
        call that warms up connections and buffers."""
        cuda = self.collective_device.type == "cuda"
        once()
        if cuda:
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        for _ in range(repeats):
            once()
        if cuda:
            torch.cuda.synchronize(self.device)
        return max(time.perf_counter() - start, 1e-9)

    def measure_gradient_collective(self, nbytes: int, sharded: bool, repeats: int = 3) -> float:
        """Collective: the bandwidth (bytes/s) of the collective that averages one chunk's
        gradients (``reduce`` to the owner under sharded state, ``all_reduce`` otherwise), on a
        buffer of ``nbytes`` (the largest chunk's trainable bytes) at the real world size.
        With no trainable chunk (LoRA: the adapters are resident) there is nothing to time: a
        one-element buffer would measure latency alone and make every D2H byte (activation
        swaps) look ~1e5x slower to the planner. The layout is the same on every rank, so
        every rank skips alike. The all-reduce, which persistent chunks' gradients take under
        either state, is timed too (``allreduce_bps``)."""
        if nbytes <= 0:
            self.gradient_bps = self.allreduce_bps = float("inf")
            return self.gradient_bps
        device = self.collective_device
        buffer = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
        dst = self.global_rank(0)

        def reduce() -> None:
            dist.reduce(buffer, dst=dst, op=dist.ReduceOp.SUM, group=self.group)

        def all_reduce() -> None:
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self.group)

        # Persistent chunks' gradients are all-reduced under either state; offloaded ones are
        # reduced to their owner under sharded state.
        timed = {"all-reduce": self.time_collective(all_reduce, repeats)}
        if sharded:
            timed["reduce"] = self.time_collective(reduce, repeats)
        # Every rank takes the slowest rank's figure: the plan is rank 0's, the wait anyone's.
        measured = torch.tensor(list(timed.values()), dtype=torch.float64, device=device)
        dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=self.group)
        rates = {
            name: buffer.numel() * buffer.element_size() * repeats / seconds
            for name, seconds in zip(timed, measured.tolist(), strict=True)
        }
        self.allreduce_bps = rates["all-reduce"]
        self.gradient_bps = rates["reduce" if sharded else "all-reduce"]
        logger.debug(
            "gradient collectives of %d MiB over %d ranks: %s",
            nbytes >> 20,
            self.world_size,
            ", ".join(f"{name} {bps / 1e9:.1f} GB/s" for name, bps in rates.items()),
        )
        return self.gradient_bps

    def effective_hardware(self, hw: HardwareProfile) -> HardwareProfile:
        """The machine as one rank's cost model sees it: an offloaded chunk's gradients go to
        the host after their collective (``_offload_averaged_grads``: the D2H copy waits for
        it), so a gradient byte costs 1 / B_d2h + 1 / B_collective seconds; persistent chunks'
        gradients are all-reduced at ``allreduce_bps`` (``cost_time.persistent_allreduce_exposed``).
        Apply after ``Sharding.effective_hardware`` (whose D2H rate already counts the owner's
        share)."""
        return replace(
            hw,
            d2h_bps=1.0 / (1.0 / hw.d2h_bps + 1.0 / self.gradient_bps),
            allreduce_bps=self.allreduce_bps,
        )

    # ---- reduction ----------------------------------------------------------------------------

    def start(
        self,
        grads: list[torch.Tensor],
        reduce: Callable[[torch.Tensor, int], Any] | None = None,
        index: int = -1,
    ) -> Reduction:
        """Average ``grads`` across ranks asynchronously; returns flat buffers and views.

        The flatten runs on the current stream; the collective on the backend's stream. With
        ``reduce`` (``Sharding.reduce``) only chunk ``index``'s owner gets the average.
        """
        works, flats, views = [], [], [None] * len(grads)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, grad in enumerate(grads):
            by_dtype.setdefault(grad.dtype, []).append(i)
        for indices in by_dtype.values():
            members = [grads[i] for i in indices]
            flat = torch.cat([g.reshape(-1) for g in members])
            works.append(self._average(flat) if reduce is None else reduce(flat, index))
            flats.append(flat)
            offset = 0
            for i, grad in zip(indices, members, strict=True):
                views[i] = flat[offset : offset + grad.numel()].view(grad.shape)
                offset += grad.numel()
            if reduce is None:
                self.reduced_bytes += flat.numel() * flat.element_size()
        return Reduction(works, flats, views)  # type: ignore[arg-type]

    def average_op(self, tensor: torch.Tensor) -> Any:
        """The reduce op that leaves the mean over ranks, ``tensor`` prepared for it."""
        if self.nccl and tensor.is_cuda:
            return dist.ReduceOp.AVG
        # gloo has no AVG: divide first (exact for power-of-two world sizes).
        tensor.div_(self.world_size)
        return dist.ReduceOp.SUM

    def _average(self, tensor: torch.Tensor) -> Any:
        """Start the in-place all-reduce that leaves the mean over ranks in ``tensor``."""
        op = self.average_op(tensor)
        return dist.all_reduce(tensor, op=op, group=self.group, async_op=True)

    def reduce_in_place(self, grads: list[torch.Tensor], flatten: bool = False) -> None:
        """Start averaging ``grads`` (``.grad`` tensors that stay where they are); :meth:`finish`
        completes it. Big tensors (a chunk's) are reduced in place, one collective each, using
        no extra memory; many small ones (adapters) are better ``flatten``-ed into one."""
        if not grads:
            return
        if flatten:
            reduction = self.start(grads)
            reduction.targets = grads
            self._pending.append(reduction)
            return
        works = [self._average(grad) for grad in grads]
        self.reduced_bytes += sum(g.numel() * g.element_size() for g in grads)
        self._pending.append(Reduction(works, [], []))

    def finish(self) -> None:
        """Wait for the pending in-place reductions (the current stream waits, on GPUs) and
        copy flattened averages back into their ``.grad`` tensors."""
        pending, self._pending = self._pending, []
        for reduction in pending:
            reduction.wait()
            if reduction.targets:
                torch._foreach_copy_(reduction.targets, reduction.views)

    def end_backward(self, resident: list[torch.nn.Parameter]) -> None:
        """End of a backward pass: average the resident trainable params' gradients (adapters),
        then write every pending average into ``.grad``."""
        if self._sync:
            grads = [p.grad for p in resident if p.grad is not None]
            self.reduce_in_place(grads, flatten=True)
        self.finish()

    def discard(self) -> None:
        """Drop pending reductions after an interrupted backward (their collectives finish)."""
        for reduction in self._pending:
            reduction.wait()
        self._pending = []


def attach_data_parallel(runtime: Runtime, settings: Settings) -> DataParallel | None:
    """Set up data parallelism for a runtime being attached (None on one rank): check that
    every rank attaches the same layout with the same settings, take rank 0's initial plan
    (budgets derived from free memory may differ per GPU), give the CPU optimizer its share
    of cores."""
    reducer = DataParallel.create(settings, runtime.device)
    if reducer is None:
        return None
    reducer.check_same(
        {
            "layout": layout_fingerprint(runtime.layout),
            "chunks": len(runtime.layout.chunks),
            "settings": {
                k: getattr(settings, k)
                for k in (
                    "offload",
                    "chunk_size",
                    "n_persist",
                    "n_buffer",
                    "n_swap",
                    "n_checkpoint",
                    "activation_mode",
                    "master_weights",
                    "budget",
                    "shard_optimizer",
                    "cpu_binding",
                    # Whether the auto mode decides (a collective) and what it plans with.
                    "update_in_backward",
                    "gpu_update_chunks",
                    "gpu_update_in_backward",
                )
            },
        }
    )
    runtime.control.adopt_plan(reducer.agree(runtime.plan))
    binding = None
    if settings.cpu_binding == "auto":
        binding = bind_near_gpu(runtime.device, reducer.rank, reducer.gather_object)
    if binding is None:
        share_cpu_threads()
    logger.debug("data parallel over %d ranks (%s)", reducer.world_size, reducer.backend)
    return reducer


def layout_fingerprint(layout: ChunkLayout) -> str:
    """A short hash of the chunk layout: names, shapes, dtypes and offsets of every slot."""
    digest = hashlib.sha256()
    for chunk in layout.chunks:
        digest.update(f"{chunk.index}:{chunk.nbytes}".encode())
        for slot in chunk.slots:
            digest.update(f"{slot.name}:{tuple(slot.shape)}:{slot.dtype}:{slot.offset}".encode())
    return digest.hexdigest()[:16]


@contextmanager
def no_sync(model: torch.nn.Module) -> Iterator[None]:
    """Skip the gradient averaging of persistent and resident params for the backward passes
    inside (gradient accumulation); the next backward outside averages the accumulated sums.

    Works like ``DistributedDataParallel.no_sync``; DDP's own ``no_sync`` works too.
    """
    reducers = [r.data_parallel for r in registry.runtimes_in(model) if r.data_parallel is not None]
    before = [r.sync for r in reducers]
    for reducer in reducers:
        reducer.set_sync(False)
    try:
        yield
    finally:
        for reducer, sync in zip(reducers, before, strict=True):
            reducer.set_sync(sync)


def local_world_size() -> int:
    """Ranks on this host, as torchrun (and accelerate launch) set ``LOCAL_WORLD_SIZE``."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def share_cpu_threads() -> None:
    """Give the CPU optimizer this rank's share of the host cores.

    ``torchrun`` sets ``OMP_NUM_THREADS=1`` when it starts several processes per node, which
    would leave the fused CPU optimizer on one core (~10x slower); each rank takes
    ``cores // local_world_size`` instead, unless the user set a larger count.
    """
    local = local_world_size()
    if local <= 1:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    share = max(1, (cores or 1) // local)
    if torch.get_num_threads() < share:
        logger.debug("CPU optimizer threads: %d -> %d", torch.get_num_threads(), share)
        torch.set_num_threads(share)
