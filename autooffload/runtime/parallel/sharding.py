"""Sharded model states across data-parallel ranks: chunk ownership and its collectives.

ZeRO-style, at chunk granularity (as Gemini and ProTrain shard chunks): each chunk has one owner,
balanced by bytes (:func:`balanced_owners`: chunks of one size go round robin, chunk ``i`` to
rank ``i % world_size``; a vocabulary chunk several blocks large counts as those blocks). Only
its owner keeps the chunk's host bytes and, if it trains, its fp32 masters, optimizer state,
host gradients and gradient staging, and only its owner updates it, so the CPU update, the H2D
and gradient D2H copies and the host memory fall ~N-fold per rank (frozen chunks, LoRA base
weights, included). The protocol:

* **backward**: the chunk's flattened gradients are ``reduce``-d (averaged) to the owner, which
  copies them to its host staging as before; the other ranks only keep the buffers alive until
  the collective is done.
* **gather** (forward and backward): the owner copies the chunk in from its host store and
  ``broadcast``-s the device bytes to the others, which receive into their chunk storage. Every
  rank gathers and prefetches the same chunks in the same order (prefetch decisions depend only
  on the plan, never on CPU timing, under sharding), so the collectives match.
* **host copies**: only the owner keeps a chunk's bytes in its host store (the only copy, so
  replicas cannot drift apart). Reading another rank's chunk
  (``state_dict``, detach) fetches it from its owner: :func:`autooffload.consolidate` on
  every rank gives its destination a copy of each, dropped at the next step.
* **optimizer state** is gathered to one rank by :meth:`Sharding.gather_states` for a checkpoint
  in torch's standard layout; loading gives every rank the whole state dict and each keeps its
  own chunks' part, so a checkpoint resumes at any world size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from autooffload.errors import AutoOffloadError
from autooffload.log import logger
from autooffload.runtime.control.host_need import chunk_host_bytes
from autooffload.runtime.parallel.lockstep import Lockstep

if TYPE_CHECKING:
    from autooffload.plan.profile_types import HardwareProfile
    from autooffload.runtime.chunks.layout import ChunkLayout, ParamSlot
    from autooffload.runtime.parallel.distributed import DataParallel
    from autooffload.runtime.runtime import Runtime
    from autooffload.settings import Settings


def balanced_owners(
    weights: Sequence[int], world_size: int, oversized: Collection[int] = ()
) -> list[int]:
    """The owning rank of each chunk, ``weights[i]`` the host bytes chunk ``i`` costs its owner.

    The ``oversized`` chunks (a parameter larger than the chunk size: an embedding or LM head of
    a large vocabulary) go first, heaviest first, each to the rank holding the fewest bytes so
    far. The others go round robin in index order, a rank skipping its turn while it holds more
    than the fewest bytes plus half the heaviest of them. Chunks of one size thus go to rank
    ``i % world_size`` as before, and consecutive chunks, gathered one after the other, have
    different owners copying them in at once, except where a rank catches up with one holding
    an oversized chunk. Plain round robin gave the 788 MB vocabulary chunk of Llama-3.2-3B
    (201 MB blocks) to rank 0 on top of its share of blocks: 2.05 GiB of chunks on rank 0 at
    four ranks, 1.31 on the others (1.48-1.50 each now). The ranks' bytes differ by at most one
    and a half of the heaviest chunk that rotates, or by an oversized chunk. Depends on the
    weights alone, so every rank computes the same owners (the layouts are checked equal at
    attach)."""
    loads = [0] * world_size
    owners = [0] * len(weights)
    for index in sorted(oversized, key=lambda i: (-weights[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += weights[index]
    placed = set(oversized)
    rest = [i for i in range(len(weights)) if i not in placed]
    slack = max((weights[i] for i in rest), default=0)
    turn = 0
    for index in rest:
        floor = min(loads) + slack // 2
        while loads[turn] > floor:
            turn = (turn + 1) % world_size
        owners[index] = turn
        loads[turn] += weights[index]
        turn = (turn + 1) % world_size
    return owners


class NotConsolidatedError(AutoOffloadError):
    """Reading weights or optimizer state that other ranks own, without consolidating first."""


class Sharding:
    """Which rank owns each offloaded chunk, and the collectives that move it."""

    def __init__(
        self,
        data_parallel: DataParallel,
        layout: ChunkLayout,
        weights: Sequence[int] | None = None,
    ) -> None:
        """``weights``: the host bytes each chunk costs its owner, by which ownership is
        balanced (``balanced_owners``); None: the chunks' bytes."""
        self.dp = data_parallel
        self.rank = data_parallel.rank
        self.world_size = data_parallel.world_size
        self.indices = frozenset(c.index for c in layout.chunks)
        if weights is None:
            weights = [c.nbytes for c in layout.chunks]
        oversized = [c.index for c in layout.chunks if c.nbytes > layout.chunk_size]
        owners = balanced_owners(weights, self.world_size, oversized)
        self._owners = {c.index: owner for c, owner in zip(layout.chunks, owners, strict=True)}
        # The chunks with optimizer state (the rest, frozen, are sharded for their bytes only).
        self.trainable = frozenset(c.index for c in layout.chunks if c.trainable_slots)
        # Bytes of the offloaded chunks other ranks own, on a rank that consolidated them
        # (``consolidate``): valid until the next step or load, which drop them.
        self._weights: dict[int, torch.Tensor] = {}
        # Inside ``shapes_only``: state-dict entries of those chunks are placeholders, one per
        # slot (tied parameters share it), by (chunk index, offset).
        self.shapes_only = False
        self.placeholders: dict[tuple[int, int], torch.Tensor] = {}
        # Optimizer step counter of the last gather_states; its result, per optimizer id.
        self.consolidated_at: int | None = None
        self.consolidated: dict[int, dict[int, dict]] = {}

        # Measured at attach (Sharding.create); used by the planner's cost model.
        self.broadcast_bps = float("inf")
        # The start-of-phase exchange (runtime/parallel/lockstep.py), made at attach.
        self.lockstep: Lockstep | None = None

    def hold_consolidated(self, weights: dict[int, torch.Tensor]) -> None:
        """Keep ``weights`` (other ranks' chunks, by index) until the next step or load."""
        self._weights = weights

    def drop_consolidated(self, index: int | None = None) -> None:
        """Forget the consolidated copy of chunk ``index`` (every chunk if None): stale now."""
        if index is None:
            self._weights = {}
        else:
            self._weights.pop(index, None)

    @staticmethod
    def create(
        settings: Settings, data_parallel: DataParallel | None, layout: ChunkLayout
    ) -> Sharding | None:
        """The sharding of a runtime being attached, or None (one rank, or switched off)."""
        if data_parallel is None or settings.shard_optimizer == "off":
            return None
        # Balanced by what the attach's host-memory check counts per chunk, every chunk
        # offloaded (the profiling steps, the host peak): host bytes, gradient staging,
        # masters, host gradients and optimizer state.
        weights = chunk_host_bytes(layout, settings.master_weights)
        sharding = Sharding(data_parallel, layout, weights)
        sharding.lockstep = Lockstep(sharding.rank, sharding.world_size)
        sharding.broadcast_bps = sharding.measure_broadcast(max(c.nbytes for c in layout.chunks))
        return sharding

    def measure_broadcast(self, nbytes: int, repeats: int = 3) -> float:
        """Collective: the broadcast bandwidth (bytes/s) of one chunk-sized buffer, as the
        gathers of sharded chunks will see it (real world size, real chunk size)."""
        buffer = torch.zeros(max(1, nbytes), dtype=torch.uint8, device=self.dp.collective_device)
        src = self.dp.global_rank(0)
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
        update, the gradient adds of accumulation and the gradient D2H copies cover 1/N of the
        offloaded trainable params
        (rates x N); a gather is 1/N of an H2D copy (the owner's) followed by a broadcast:
        1 / B_gather = 1 / (N B_h2d) + 1 / B_broadcast  (s/byte), for frozen chunks too."""
        n = self.world_size
        gather_bps = 1.0 / (1.0 / (n * hw.h2d_bps) + 1.0 / self.broadcast_bps)
        return replace(
            hw,
            cpu_optim_params_per_s=self.model_rate(hw.cpu_optim_params_per_s),
            cpu_accumulate_params_per_s=self.model_rate(hw.cpu_accumulate_params_per_s),
            d2h_bps=self.model_rate(hw.d2h_bps),
            h2d_bps=gather_bps,
            duplex_bps=1.0 / (1.0 / (n * hw.duplex_bps) + 1.0 / self.broadcast_bps),
        )

    def model_rate(self, rank_rate: float) -> float:
        """A rate over this rank's 1/N of the offloaded params (its CPU update, adds and
        gradient copies) as the cost model, which charges the whole model, takes it."""
        return rank_rate * self.world_size

    def check_in_step(self, phase: int, persistent: set[int]) -> None:
        """Where the plan gathers sharded chunks, every rank starts ``phase`` (a forward with or
        without gradients, a backward, a backward's end) after the same chunk collectives, or
        all raise (runtime/parallel/lockstep.py)."""
        if self.lockstep is not None and not self.indices <= persistent:
            self.lockstep.check(phase)

    def owner(self, index: int) -> int:
        """Group rank owning chunk ``index`` (``balanced_owners``)."""
        return self._owners[index]

    def owns(self, index: int) -> bool:
        return self.owner(index) == self.rank

    def hosts(self, index: int) -> bool:
        """Whether this rank keeps chunk ``index``'s bytes on its host (it owns the chunk)."""
        return self.owns(index)

    def applies(self, index: int, persistent: set[int]) -> bool:
        """Whether chunk ``index`` is sharded now (offloaded: its gathers are broadcasts)."""
        return index not in persistent

    # ---- collectives --------------------------------------------------------------------------

    def _src(self, index: int) -> int:
        return self.dp.global_rank(self.owner(index))

    def broadcast(self, tensor: torch.Tensor, index: int) -> Any:
        """Start sending the owner's ``tensor`` (chunk bytes) to the other ranks."""
        if self.lockstep is not None:
            self.lockstep.issued(index)
        return dist.broadcast(tensor, src=self._src(index), group=self.dp.group, async_op=True)

    def reduce(self, flat: torch.Tensor, index: int) -> Any:
        """Start averaging ``flat`` (a chunk's gradients) into the owner's copy."""
        op = self.dp.average_op(flat)
        self.dp.reduced_bytes += flat.numel() * flat.element_size()
        if self.lockstep is not None:
            self.lockstep.issued(-1 - index)
        return dist.reduce(flat, dst=self._src(index), op=op, group=self.dp.group, async_op=True)

    def all_reduce_(self, value: torch.Tensor, op: Any = None) -> torch.Tensor:
        """Sum (or ``op``) a small tensor over the ranks, in place, on the collective's device."""
        op = dist.ReduceOp.SUM if op is None else op
        staged = value.to(self.dp.device) if self.dp.nccl else value.cpu()
        dist.all_reduce(staged, op=op, group=self.dp.group)
        value.copy_(staged)
        return value

    def fetch(
        self, host: torch.Tensor | None, index: int, nbytes: int, dst: int | None
    ) -> torch.Tensor | None:
        """Collective (every rank calls it alike): the owner's host bytes ``host`` of chunk
        ``index`` as a CPU tensor on group rank ``dst`` (every rank if None); None elsewhere,
        the owner included. One rank receives by point-to-point; every rank, by broadcast."""
        owns = self.owns(index)
        if dst is not None and self.owner(index) == dst:
            return None
        receives = not owns and dst in (None, self.rank)
        if not owns and not receives:
            return None
        device = self.dp.collective_device
        if owns:
            assert host is not None
            staged = host.to(device) if device.type != "cpu" else host
        else:
            staged = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if dst is None:
            dist.broadcast(staged, src=self._src(index), group=self.dp.group)
        elif owns:
            dist.send(staged, dst=self.dp.global_rank(dst), group=self.dp.group)
        else:
            dist.recv(staged, src=self._src(index), group=self.dp.group)
        return staged.cpu() if receives else None

    def weight_alias(self, index: int, slot: ParamSlot) -> torch.Tensor:
        """A parameter of another rank's chunk ``index`` from its consolidated bytes, as a
        tensor of its own storage (see ``HostArena.alias``)."""
        weights = self._weights.get(index)
        if weights is None and self.shapes_only:
            # Not meta: safetensors finds tied parameters by their storage and skips meta
            # tensors, so a tied pair of a chunk this rank lacks read as two tensors, one
            # missing from the file (flaky with the plan: only offloaded chunks of another
            # rank). One uninitialised host tensor per slot: its pages are never touched.
            key = (index, slot.offset)
            if key not in self.placeholders:
                self.placeholders[key] = torch.empty(slot.shape, dtype=slot.dtype)
            return self.placeholders[key]
        if weights is None:
            raise self.not_consolidated("model.state_dict()")
        if slot.nbytes == 0:
            return torch.empty(slot.shape, dtype=slot.dtype)
        count = slot.nbytes // slot.dtype.itemsize
        return torch.frombuffer(
            weights.numpy(), dtype=slot.dtype, count=count, offset=slot.offset
        ).view(slot.shape)

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
            dist.gather_object(mine, box, dst=self.dp.global_rank(dst), group=self.dp.group)
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
            f"{what} on rank {self.rank} reads offloaded chunks that other ranks own (weights"
            f" and CPU optimizer state are sharded over {self.world_size} ranks,"
            " AUTOOFFLOAD_SHARD_OPTIMIZER=auto); call autooffload.consolidate(model) on every"
            f" rank first (to={self.rank} for this rank, to=None for all), then read it there,"
            " or set AUTOOFFLOAD_SHARD_OPTIMIZER=off"
        )

    def readable(self, persistent: set[int]) -> bool:
        """Whether every offloaded chunk is hosted here or consolidated to this rank (or only
        names and shapes are asked for, ``shapes_only``)."""
        return self.shapes_only or all(
            index in self._weights or self.hosts(index) or index in persistent
            for index in self.indices
        )


@contextlib.contextmanager
def shapes_only(runtimes: list[Runtime]) -> Iterator[None]:
    """In the block, ``model.state_dict()`` on a rank without every chunk gives uninitialised
    placeholders (tied parameters share one) for those it lacks instead of raising: for
    callers that read only names, shapes and storage sharing before they load a state dict
    (safetensors' ``load_model``, which ``Accelerator.load_state`` uses). Nothing read there
    is saved."""
    shardings = [r.manager.sharding for r in runtimes if r.manager.sharding is not None]
    for sharding in shardings:
        sharding.shapes_only = True
    try:
        yield
    finally:
        for sharding in shardings:
            sharding.shapes_only = False
            sharding.placeholders = {}


def fetch_offloaded(runtime: Runtime, dst: int | None) -> dict[int, torch.Tensor]:
    """Collective under sharding: the bytes of every offloaded chunk that group rank ``dst``
    (every rank if None) does not host, on that rank, by index; {} elsewhere."""
    manager = runtime.manager
    sharding = manager.sharding
    if sharding is None:
        return {}
    runtime.synchronize()
    fetched = {}
    for index in sorted(sharding.indices - manager.persistent):
        host = None
        if sharding.owns(index):
            manager.host_busy.wait(index)
            host = manager.host.view(index)
        got = sharding.fetch(host, index, manager.chunks[index].nbytes, dst)
        if got is not None:
            fetched[index] = got
    return fetched


def consolidate(runtime: Runtime, dst: int | None = 0) -> None:
    """Collective: copy the sharded weights and optimizer state of every bound optimizer to
    group rank ``dst`` (every rank if None), where ``model.state_dict()`` and
    ``optimizer.state_dict()`` then return them in torch's standard layout (until the next
    step)."""
    sharding = runtime.manager.sharding
    if sharding is None:
        return
    sharding.hold_consolidated(fetch_offloaded(runtime, dst))
    cpu_optim = runtime.cpu_optim
    chunks = runtime.layout.chunks
    indices = sorted(i for i in sharding.trainable if runtime.manager.is_sharded(i))
    consolidated: dict[int, dict[int, dict]] = {}
    # The optimizers that still exist on every rank (one a script dropped may wait for the
    # garbage collector on some), in binding order: one collective each.
    twins = cpu_optim.twins
    live = {twins.serial_of(o): o for o in twins.optimizers}
    agreed = set(live).intersection(*sharding.dp.gather_object(sorted(live)))
    for optimizer in (live[serial] for serial in sorted(agreed)):
        payloads: dict[int, dict[str, dict]] = {}
        for index in indices:
            twin = cpu_optim.twins.get(index, optimizer)
            if not sharding.owns(index) or twin is None:
                continue
            payloads[index] = {
                slot.name: dict(twin.state[master])
                for slot in chunks[index].trained_slots
                if (master := cpu_optim.masters.get(id(slot.param))) is not None
                and master in twin.state
            }
        merged = sharding.gather_states(payloads, indices, dst)
        consolidated[id(optimizer)] = {
            id(slot.param): by_name[slot.name]
            for index, by_name in merged.items()
            for slot in chunks[index].trained_slots
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
