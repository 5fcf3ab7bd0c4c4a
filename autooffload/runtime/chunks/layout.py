"""ChunkLayout: parameters laid into fixed-size byte chunks in execution order."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

ALIGN = 64  # bytes; keeps every param view aligned for any dtype and for vectorised kernels


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(eq=False)
class ParamSlot:
    """Where one parameter lives inside its chunk."""

    param: nn.Parameter
    name: str
    offset: int
    nbytes: int
    shape: torch.Size
    dtype: torch.dtype
    # Whether the param required grad when the layout was made (at attach): those have host
    # gradient buffers, masters and optimizer state while offloaded, frozen later or not.
    trained: bool = False

    @property
    def numel(self) -> int:
        return self.shape.numel()


@dataclass(eq=False)
class Chunk:
    """A contiguous run of parameters that moves between host and GPU as one copy."""

    index: int
    nbytes: int = 0
    slots: list[ParamSlot] = field(default_factory=list)
    groups: set[int] = field(default_factory=set)

    @property
    def trainable_slots(self) -> list[ParamSlot]:
        """Slots whose param requires grad now."""
        return [s for s in self.slots if s.param.requires_grad]

    @property
    def trained_slots(self) -> list[ParamSlot]:
        """Slots whose param required grad at attach (frozen since or not): the ones with
        optimizer state to keep."""
        return [s for s in self.slots if s.trained]

    @property
    def trainable_bytes(self) -> int:
        return sum(s.nbytes for s in self.trainable_slots)


@dataclass
class ChunkLayout:
    """Chunks in execution order, and for each group the chunks it needs."""

    chunk_size: int
    chunks: list[Chunk]
    chunks_of_group: dict[int, list[int]]

    @property
    def total_bytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    def slot_of(self) -> dict[int, tuple[Chunk, ParamSlot]]:
        return {id(s.param): (c, s) for c in self.chunks for s in c.slots}


def build_layout(
    params_by_group: Sequence[tuple[int, Sequence[tuple[str, nn.Parameter]]]],
    chunk_size: int,
    companions: Mapping[int, Sequence[tuple[str, torch.Tensor]]] | None = None,
) -> ChunkLayout:
    """Lay parameters into chunks of ``chunk_size`` bytes, in the given group order.

    A parameter that does not fit in the current chunk starts the next one; a parameter larger
    than ``chunk_size`` gets a chunk of its own size. A parameter shared by several groups
    (tied weights) is stored once, where it is first seen, and its chunk is needed by all of them.
    ``companions`` (param id -> tensors named relative to it: a quantized weight's quant state)
    are laid right after their param, in the same chunk: the param and its companions fit or
    move on as one.
    """
    companions = companions or {}
    chunks: list[Chunk] = []
    placed: dict[int, Chunk] = {}
    chunks_of_group: dict[int, list[int]] = {}
    current: Chunk | None = None
    for group_index, params in params_by_group:
        needed: list[int] = []
        for name, param in params:
            chunk = placed.get(id(param))
            if chunk is None:
                unit = [(name, param)]
                unit += [(f"{name}.{suffix}", t) for suffix, t in companions.get(id(param), ())]
                unit_bytes = sum(_align(t.numel() * t.element_size()) for _, t in unit)
                if current is None or current.nbytes + unit_bytes > chunk_size:
                    current = Chunk(index=len(chunks))
                    chunks.append(current)
                for tensor_name, tensor in unit:
                    nbytes = tensor.numel() * tensor.element_size()
                    slot = ParamSlot(
                        tensor,
                        tensor_name,
                        current.nbytes,
                        nbytes,
                        tensor.shape,
                        tensor.dtype,
                        trained=tensor.requires_grad,
                    )
                    current.slots.append(slot)
                    current.nbytes += _align(nbytes)
                    placed[id(tensor)] = current
                chunk = current
            chunk.groups.add(group_index)
            if chunk.index not in needed:
                needed.append(chunk.index)
        chunks_of_group[group_index] = needed
    return ChunkLayout(chunk_size, chunks, chunks_of_group)


def default_chunk_size(block_bytes: Sequence[int]) -> int:
    """One chunk per block when blocks are 32-512 MiB: a block then needs exactly one copy."""
    mib = 1 << 20
    if not block_bytes:
        return 64 * mib
    largest = max(block_bytes)
    return min(max(largest, 32 * mib), 512 * mib)


def aligned_bytes(params: Sequence[nn.Parameter]) -> int:
    """Bytes ``params`` take in a chunk, alignment padding included."""
    return sum(_align(p.numel() * p.element_size()) for p in params)


def slot_view(flat: torch.Tensor, slot: ParamSlot, offset: int | None = None) -> torch.Tensor:
    """``slot``'s tensor in a chunk's bytes ``flat`` (at ``offset`` instead of its own)."""
    start = slot.offset if offset is None else offset
    return flat[start : start + slot.nbytes].view(slot.dtype).view(slot.shape)
