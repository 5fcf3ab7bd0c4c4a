"""Where a model's tensors live while attached: which trainable params stay resident, the
chunk layout of the rest, moving the model onto the device at attach (params into the host
store, resident params and buffers to the device, every replica rank 0's) and back at detach."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from autooffload.errors import PlanError
from autooffload.runtime.adapters import adapter_params
from autooffload.runtime.blocks import Group
from autooffload.runtime.chunks.layout import (
    ChunkLayout,
    aligned_bytes,
    build_layout,
    default_chunk_size,
)
from autooffload.runtime.quantized import QuantizedParams

if TYPE_CHECKING:
    from autooffload.runtime.chunks.store import ChunkManager
    from autooffload.runtime.parallel.distributed import DataParallel

# Below this share of the model's bytes, trainable params stay resident.
RESIDENT_TRAINABLE_SHARE = 0.1


def resident_trainable_params(model: nn.Module, quantized: QuantizedParams) -> list[nn.Parameter]:
    """Trainable params kept on the GPU outside chunks: adapters of a mostly frozen model.

    When under ``RESIDENT_TRAINABLE_SHARE`` of the bytes train (LoRA, DoRA, prompt tuning),
    streaming them would put the CPU optimizer on the critical path for a few MB; kept
    resident they are updated by the user's optimizer, and frozen chunks need H2D only.
    PEFT adapters count as trainable whether active or not (``set_adapter`` switches them).
    """
    params = list(dict.fromkeys(model.parameters()))
    total = sum(p.numel() * p.element_size() for p in params) + quantized.nbytes
    switchable = {id(p) for p in adapter_params(model)}
    trainable = [p for p in params if p.requires_grad or id(p) in switchable]
    trainable_bytes = sum(p.numel() * p.element_size() for p in trainable)
    if not trainable or trainable_bytes >= RESIDENT_TRAINABLE_SHARE * total:
        return []
    return trainable


def chunk_layout(
    groups: list[Group],
    resident_params: list[nn.Parameter],
    quantized: QuantizedParams,
    chunk_size: int | None,
) -> ChunkLayout:
    """The chunks of every group's params but the resident ones, in execution order
    (``chunk_size`` None: the largest block's bytes, ``chunks.default_chunk_size``)."""
    resident_ids = {id(p) for p in resident_params}
    params_by_group = [
        (g.index, [(n, p) for n, p in g.params() if id(p) not in resident_ids]) for g in groups
    ]
    block_bytes = [
        aligned_bytes([t for _, p in params for t in (p, *quantized.of(p))])
        for g, (_, params) in zip(groups, params_by_group, strict=True)
        if g.is_block
    ]
    size = chunk_size or default_chunk_size(block_bytes)
    return build_layout(params_by_group, size, quantized.named())


def place_on_device(
    model: nn.Module,
    manager: ChunkManager,
    quantized: QuantizedParams,
    resident_params: list[nn.Parameter],
    data_parallel: DataParallel | None,
) -> None:
    """Chunked params into the host store (their device views empty until gathered), resident
    params and buffers onto the device. Under data parallelism every replica starts as rank
    0's (as DDP makes it when it wraps a model): a sharded chunk's only copy is its owner's,
    and replicas built from different seeds (PEFT's random adapter init) would otherwise
    train apart."""
    dp = data_parallel
    manager.adopt_params(sync=None if dp is None else lambda t: dp.broadcast_([t]))
    quantized.bind_aliases(model.parameters())
    for param in resident_params:
        param.data = param.data.to(manager.device)
    _buffers_to(model, manager.device)
    if dp is not None:
        dp.broadcast_([p.data for p in resident_params])
        dp.broadcast_([b for b in model.buffers() if b is not None])


def return_from_device(
    model: nn.Module,
    manager: ChunkManager,
    quantized: QuantizedParams,
    resident_params: list[nn.Parameter],
    target: torch.device,
    fetched: dict[int, torch.Tensor] | None,
) -> None:
    """Every param and buffer an ordinary tensor on ``target`` again (detach); ``fetched``:
    the chunks other ranks own, gathered before."""
    manager.materialize(target, fetched)
    quantized.bind_aliases(model.parameters())
    quantized.restore(target)
    for param in resident_params:
        param.data = param.data.to(target)
    _buffers_to(model, target)


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = buffer.to(device)


def on_every_rank(data_parallel: DataParallel | None, check: Callable[[], None]) -> None:
    """Run an attach-time ``check``; under data parallelism a failure on any rank fails every
    rank's attach with it (a rank left attaching alone would hang in the next collective)."""
    try:
        check()
        problem = None
    except PlanError as error:
        problem = error
    if data_parallel is not None:
        messages = data_parallel.gather_object(None if problem is None else str(problem))
        failed = [(rank, m) for rank, m in enumerate(messages) if m is not None]
        if failed and problem is None:
            rank, message = failed[0]
            raise PlanError(f"rank {rank}: {message}")
    if problem is not None:
        raise problem


def host_param_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters in host memory now (the host store replaces them)."""
    params = dict.fromkeys(model.parameters())
    return sum(p.numel() * p.element_size() for p in params if p.device.type == "cpu")
