"""Sharded CPU optimizer state across data-parallel ranks: chunk ownership and its collectives.

ZeRO-style, at chunk granularity (as Gemini and ProTrain shard chunks): the offloaded trainable
chunk ``i`` belongs to rank ``i % world_size``. Only its owner keeps the chunk's fp32 masters,
optimizer state, host gradients and gradient staging, and only its owner updates it, so the CPU
update, the gradient D2H copies and that host memory fall ~N-fold per rank. The protocol:

* **backward**: the chunk's flattened gradients are ``reduce``-d (averaged) to the owner, which
  copies them to its host staging as before; the other ranks only keep the buffers alive until
  the collective is done.
* **gather** (forward and backward): the owner copies the chunk in from its host store and
  ``broadcast``-s the device bytes to the others, which receive into their chunk storage. Every
  rank gathers and prefetches the same chunks in the same order (prefetch decisions depend only
  on the plan, never on CPU timing, under sharding), so the collectives match.
* **host copies**: a non-owner's host store keeps the chunk's bytes of the last
  :meth:`Sharding.refresh_hosts` (attach, load, consolidate); chunks stepped since are
  ``dirty``, the same set on every rank. Reading them (``state_dict``, detach) needs the
  collective refresh first: :func:`autooffload.consolidate` on every rank.
* **optimizer state** is gathered to one rank by :meth:`Sharding.gather_states` for a checkpoint
  in torch's standard layout; loading gives every rank the whole state dict and each keeps its
  own chunks' part, so a checkpoint resumes at any world size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from autooffload.errors import AutoOffloadError
from autooffload.log import logger

if TYPE_CHECKING:
    from autooffload.plan.profile_types import HardwareProfile
    from autooffload.runtime.chunks import ChunkLayout
    from autooffload.runtime.distributed import DataParallel
    from autooffload.runtime.runtime import Runtime
    from autooffload.settings import Settings


class NotConsolidatedError(AutoOffloadError):
    """Reading weights or optimizer state that other ranks own, without consolidating first."""


class Sharding:
    """Which rank owns each offloaded trainable chunk, and the collectives that move it."""

    def __init__(self, data_parallel: DataParallel, layout: ChunkLayout) -> None:
        self.dp = data_parallel
        self.rank = data_parallel.rank
        self.world_size = data_parallel.world_size
        self.trainable = frozenset(c.index for c in layout.chunks if c.trainable_slots)
        # Sharded chunks stepped since the last host refresh (identical on every rank).
        self.dirty: set[int] = set()
        # Optimizer step counter of the last gather_states; its result, per optimizer id.
        self.consolidated_at: int | None = None
        self.consolidated: dict[int, dict[int, dict]] = {}
        # Measured at attach (Sharding.create); used by the planner's cost model.
        self.broadcast_bps = float("inf")

    @staticmethod
    def create(
        settings: Settings, data_parallel: DataParallel | None, layout: ChunkLayout
    ) -> Sharding | None:
        """The sharding of a runtime being attached, or None (one rank, or switched off)."""
        if data_parallel is None or settings.shard_optimizer == "off":
            return None
        if not any(c.trainable_slots for c in layout.chunks):
            return None  # frozen chunks (LoRA base weights) have no optimizer state to shard
        sharding = Sharding(data_parallel, layout)
        sharding.broadcast_bps = sharding.measure_broadcast(max(c.nbytes for c in layout.chunks))
        return sharding

    def measure_broadcast(self, nbytes: int, repeats: int = 3) -> float:
        """Collective: the broadcast bandwidth (bytes/s) of one chunk-sized buffer, as the
        gathers of sharded chunks will see it (real world size, real chunk size)."""
        buffer = torch.zeros(max(1, nbytes), dtype=torch.uint8, device=self.dp.collective_device)
        src = self.dp._global_rank(0)
        seconds = self.dp.time_collective(
            lambda: dist.broadcast(buffer, src=src, group=self.dp.group), repeats
        )
        bps = buffer.numel() * repeats / seconds
        logger.debug(
            "broadcast of %d MiB over %d ranks: %.1f GB/s", nbytes >> 20, self.world_size, bps / 1e9
        )
        return bps

    def effective_hardware(self, hw: HardwareProfile) -> HardwareProfile:
        """The machine as one rank's cost model sees it under sharding. Per rank, the CPU
        update and the gradient D2H copies cover 1/N of the offloaded trainable params
        (rates x N); a gather is 1/N of an H2D copy (the owner's) followed by a broadcast:
        1 / B_gather = 1 / (N B_h2d) + 1 / B_broadcast  (s/byte). Frozen chunks (not sharded)
        are costed the same way: an approximation for models mixing both."""
        n = self.world_size
        gather_bps = 1.0 / (1.0 / (n * hw.h2d_bps) + 1.0 / self.broadcast_bps)
        return replace(
            hw,
            cpu_optim_params_per_s=hw.cpu_optim_params_per_s * n,
            d2h_bps=hw.d2h_bps * n,
            h2d_bps=gather_bps,
            duplex_bps=1.0 / (1.0 / (n * hw.duplex_bps) + 1.0 / self.broadcast_bps),
        )

    def owner(self, index: int) -> int:
        """Group rank owning chunk ``index``."""
        return index % self.world_size

    def owns(self, index: int) -> bool:
        return self.owner(index) == self.rank

    def applies(self, index: int, persistent: set[int]) -> bool:
        """Whether chunk ``index`` is sharded now (trainable and offloaded)."""
        return index in self.trainable and index not in persistent

    # ---- collectives --------------------------------------------------------------------------

    def _src(self, index: int) -> int:
        return self.dp._global_rank(self.owner(index))

    def broadcast(self, tensor: torch.Tensor, index: int) -> Any:
        """Start sending the owner's ``tensor`` (chunk bytes) to the other ranks."""
        return dist.broadcast(tensor, src=self._src(index), group=self.dp.group, async_op=True)

    def reduce(self, flat: torch.Tensor, index: int) -> Any:
        """Start averaging ``flat`` (a chunk's gradients) into the owner's copy."""
        op = self.dp.average_op(flat)
        self.dp.reduced_bytes += flat.numel() * flat.element_size()
        return dist.reduce(flat, dst=self._src(index), op=op, group=self.dp.group, async_op=True)

    def all_reduce_(self, value: torch.Tensor, op: Any = None) -> torch.Tensor:
        """Sum (or ``op``) a small tensor over the ranks, in place, on the collective's device."""
        op = dist.ReduceOp.SUM if op is None else op
        staged = value.to(self.dp.device) if self.dp.nccl else value.cpu()
        dist.all_reduce(staged, op=op, group=self.dp.group)
        value.copy_(staged)
        return value

    def refresh_hosts(
        self, host_view: Callable[[int], torch.Tensor], before_read: Callable[[int], None]
    ) -> None:
        """Collective: every rank's host store gets the owners' bytes of the dirty chunks."""
        for index in sorted(self.dirty):
            host = host_view(index)
            if self.owns(index):
                before_read(index)
            if self.dp.nccl:
                if self.owns(index):
                    staged = host.to(self.dp.device, non_blocking=True)
                else:
                    staged = torch.empty_like(host, device=self.dp.device)
                self.broadcast(staged, index).wait()
                if not self.owns(index):
                    host.copy_(staged)
            else:
                self.broadcast(host, index).wait()
        self.dirty.clear()

    def gather_states(
        self, payloads: dict[int, Any], indices: Sequence[int], dst: int | None
    ) -> dict:
        """Collective: the owners' ``payloads[index]`` of every chunk in ``indices`` (same on
        all ranks), merged on group rank ``dst`` (the others get {}), or on all if None."""
        merged: dict[int, Any] = {}
        for index in indices:
            if dst is None:
                merged[index] = self.broadcast_object(payloads.get(index, {}), index)
                continue
            if self.owner(index) == dst:
                if self.rank == dst:
                    merged[index] = payloads.get(index, {})
                continue
            box: list[Any] | None = [None] * self.world_size if self.rank == dst else None
            mine = payloads.get(index, {}) if self.owns(index) else None
            dist.gather_object(mine, box, dst=self.dp._global_rank(dst), group=self.dp.group)
            if box is not None:
                merged[index] = box[self.owner(index)]
        return merged

    def broadcast_states(self, states: dict[str, dict | None], index: int) -> dict:
        """Collective: the owner's optimizer states of chunk ``index`` (per param name) on every
        rank. Only the layout travels pickled; tensors go by ``broadcast`` on the collective's
        device (pickling GBs of state through an object broadcast took ~30 s at 3B)."""
        layout = {
            name: None
            if state is None
            else {
                key: (value.dtype, tuple(value.shape)) if isinstance(value, torch.Tensor) else value
                for key, value in state.items()
            }
            for name, state in states.items()
        }
        layout = self.broadcast_object(layout, index)
        device = self.dp.device if self.dp.nccl else torch.device("cpu")
        result: dict[str, dict | None] = {}
        for name, keys in layout.items():
            if keys is None:
                result[name] = None
                continue
            result[name] = {}
            for key, spec in keys.items():
                if not (isinstance(spec, tuple) and spec and isinstance(spec[0], torch.dtype)):
                    result[name][key] = spec
                    continue
                if self.owns(index):
                    tensor = states[name][key].to(device).contiguous()  # type: ignore[index]
                else:
                    tensor = torch.empty(spec[1], dtype=spec[0], device=device)
                dist.broadcast(tensor, src=self._src(index), group=self.dp.group)
                result[name][key] = tensor
        return result

    def broadcast_object(self, value: Any, index: int) -> Any:
        """Collective: the owner's ``value`` on every rank."""
        box = [value if self.owns(index) else None]
        dist.broadcast_object_list(box, src=self._src(index), group=self.dp.group)
        return box[0]

    def not_consolidated(self, what: str) -> NotConsolidatedError:
        return NotConsolidatedError(
            f"{what} reads offloaded chunks that other ranks own and updated (the CPU optimizer"
            f" state is sharded over {self.world_size} ranks, AUTOOFFLOAD_SHARD_OPTIMIZER=auto);"
            " call autooffload.consolidate(model) on every rank first, then save on one, or set"
            " AUTOOFFLOAD_SHARD_OPTIMIZER=off"
        )


def refresh_hosts(runtime: Runtime) -> None:
    """Collective under sharding: every rank's host store holds the current weights of every
    chunk (a no-op, and no collective, when nothing was stepped since the last refresh)."""
    manager = runtime.manager
    sharding = manager.sharding
    if sharding is None or not sharding.dirty:
        return
    runtime.synchronize()
    sharding.refresh_hosts(
        manager.host_for_write, lambda index: manager._wait(manager.host_busy, index)
    )


def consolidate(runtime: Runtime, dst: int | None = 0) -> None:
    """Collective: refresh every rank's host weights and gather the sharded optimizer state of
    every bound optimizer to group rank ``dst`` (every rank if None), where
    ``optimizer.state_dict()`` then returns it in torch's standard layout (until the next
    step)."""
    sharding = runtime.manager.sharding
    if sharding is None:
        return
    refresh_hosts(runtime)
    runtime.synchronize()
    cpu_optim = runtime.cpu_optim
    chunks = runtime.layout.chunks
    indices = sorted(i for i in sharding.trainable if runtime.manager.is_sharded(i))
    consolidated: dict[int, dict[int, dict]] = {}
    for optimizer in runtime.optimizers:
        payloads: dict[int, dict[str, dict]] = {}
        for index in indices:
            twin = cpu_optim.twins.get((index, id(optimizer)))
            if not sharding.owns(index) or twin is None:
                continue
            payloads[index] = {
                slot.name: dict(twin.state[master])
                for slot in chunks[index].trainable_slots
                if (master := cpu_optim.masters.get(id(slot.param))) is not None
                and master in twin.state
            }
        merged = sharding.gather_states(payloads, indices, dst)
        consolidated[id(optimizer)] = {
            id(slot.param): by_name[slot.name]
            for index, by_name in merged.items()
            for slot in chunks[index].trainable_slots
            if slot.name in by_name
        }
    sharding.consolidated = consolidated if dst in (None, sharding.rank) else {}
    sharding.consolidated_at = runtime.steps_taken


def consolidated_states(runtime: Runtime, optimizer: torch.optim.Optimizer) -> dict[int, dict]:
    """The gathered state of ``optimizer``'s sharded params per param id; raises
    ``NotConsolidatedError`` unless :func:`consolidate` ran for this rank since the last step."""
    sharding = runtime.manager.sharding
    assert sharding is not None
    if runtime.steps_taken == 0:
        return {}  # no state yet anywhere (accelerate reads it when it wraps the optimizer)
    states = sharding.consolidated.get(id(optimizer))
    if sharding.consolidated_at != runtime.steps_taken or states is None:
        raise sharding.not_consolidated("optimizer.state_dict()")
    return states
