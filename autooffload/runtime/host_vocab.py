"""Serve a frozen embedding's rows and a frozen head's tiles from the host store.

A vocabulary weight is the largest tensor of a decoder (Llama-3: 128256 x 4096 bf16, 1.05 GB,
beside 436 MB blocks or 110 MB nf4 ones), and a chunk gathered whole puts all of it on the
device. When it is frozen, its forward and backward need far less of it at once:

- an ``nn.Embedding``'s forward reads only the rows the batch indexes: the indices come to the
  host (one synchronisation), the rows are gathered from the host store into a pinned buffer,
  and only they are copied in. Its backward reads no weight.
- an ``nn.Linear`` head's forward is a matmul per vocabulary tile, each tile copied in on the
  chunk store's H2D stream while the previous one multiplies (two tiles on the device at
  once); its backward copies the tiles in again and sums each tile's contribution to the
  input's gradient in fp32. The logits are the same tensor the head makes whole.

Both are exact: the rows are the weight's rows, the logits' elements are the same dot products
(computed per tile), and the input's gradient is the same sum in another order. The plan decides
which chunks are served (``Plan.host_served_chunks``, ``plan/configuration.py``'s
``with_served_chunks_gathered`` is the alternative it weighs); a served chunk stays in the host
store and the group hooks never gather it. Only a chunk holding one frozen weight of an exact
``nn.Embedding`` (no ``max_norm``) or bias-free ``nn.Linear``, used by one group, on one
process, qualifies: a trained or tied vocabulary is gathered as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from autooffload.runtime.chunks.layout import Chunk, ChunkLayout, slot_view
from autooffload.runtime.forward_wrap import install_forward, remove_forward

if TYPE_CHECKING:
    from autooffload.runtime.blocks import Group
    from autooffload.runtime.chunks.store import ChunkManager

# Where a served module keeps its ``forward_wrap`` state.
_KEY = "_autooffload_host_vocab"
# Bytes of one head tile: small enough that two of them are a fraction of a block, large enough
# that a tile's matmul keeps the device busy (Llama-3 head: 16 tiles of 8016 rows).
HEAD_TILE_BYTES = 64 << 20


@dataclass(frozen=True)
class ServedBytes:
    """What serving a chunk copies and holds for one forward and backward, bytes."""

    fwd: int
    bwd: int
    device: int


@dataclass(eq=False)
class ServedChunk:
    """One chunk that can be served from the host: its module, how, and its weight's slot."""

    chunk: Chunk
    module: nn.Module
    kind: str
    """"rows" (an embedding) or "tiles" (a head)."""

    @property
    def weight_shape(self) -> torch.Size:
        return self.chunk.slots[0].shape

    def tile_rows(self) -> int:
        """Rows of the head per tile."""
        shape = self.weight_shape
        row_bytes = max(1, shape[1:].numel() * self.chunk.slots[0].param.element_size())
        return max(1, min(shape[0], HEAD_TILE_BYTES // row_bytes))

    def bytes_for(self, tokens: int) -> ServedBytes:
        """Bytes moved and held for a batch of ``tokens`` tokens."""
        slot = self.chunk.slots[0]
        row_bytes = slot.nbytes // max(1, self.weight_shape[0])
        if self.kind == "rows":
            return ServedBytes(fwd=tokens * row_bytes, bwd=0, device=0)
        return ServedBytes(
            fwd=slot.nbytes, bwd=slot.nbytes, device=2 * self.tile_rows() * row_bytes
        )


def _servable(chunk: Chunk, module: nn.Module, chunk_size: int) -> str:
    """How ``chunk`` can be served ("rows", "tiles"), or "" where it cannot."""
    if len(chunk.slots) != 1 or len(chunk.groups) != 1 or chunk.nbytes <= chunk_size:
        return ""
    if "forward" in module.__dict__:
        return ""  # another library replaced this module's forward
    param = chunk.slots[0].param
    if param.requires_grad or not param.dtype.is_floating_point:
        return ""
    if type(module) is nn.Embedding and module.weight is param and module.max_norm is None:
        return "rows"
    if type(module) is nn.Linear and module.weight is param and module.bias is None:
        return "tiles"
    return ""


def servable_chunks(groups: list[Group], layout: ChunkLayout) -> dict[int, ServedChunk]:
    """The chunks of ``layout`` that can be served from the host, by index."""
    servable: dict[int, ServedChunk] = {}
    by_index = {g.index: g for g in groups}
    for chunk in layout.chunks:
        if len(chunk.groups) != 1:
            continue
        module = by_index[next(iter(chunk.groups))].module
        kind = _servable(chunk, module, layout.chunk_size)
        if kind:
            servable[chunk.index] = ServedChunk(chunk, module, kind)
    return servable


class HostVocab:
    """The chunks of one model that can be served from the host, and which of them are."""

    def __init__(
        self, groups: list[Group], layout: ChunkLayout, manager: ChunkManager, enabled: bool
    ) -> None:
        self.manager = manager
        self.servable = servable_chunks(groups, layout) if enabled else {}
        self.served: frozenset[int] = frozenset()
        self._pinned_rows: _PinnedRows | None = None

    def eligible(self, n_persist: int = 0) -> tuple[int, ...]:
        """Servable chunks at or above ``n_persist`` (the first ``n_persist`` a user pinned)."""
        return tuple(sorted(i for i in self.servable if i >= n_persist))

    def still_servable(self, index: int) -> bool:
        """Whether chunk ``index`` still qualifies (its weight may have been unfrozen since)."""
        served = self.servable.get(index)
        return served is not None and not served.chunk.slots[0].param.requires_grad

    def servable_of(self, indices: Iterable[int]) -> frozenset[int]:
        """Those of ``indices`` that can be served now."""
        return frozenset(i for i in indices if self.still_servable(i))

    def serve(self, indices: Iterable[int]) -> None:
        """Serve exactly those of ``indices`` that can be served from the host; the others go
        back to their module's own forward and are gathered by the hooks."""
        wanted = self.servable_of(indices)
        for index in self.served - wanted:
            self._restore(self.servable[index].module)
        for index in wanted - self.served:
            served = self.servable[index]
            self.manager.release(index)
            module = served.module
            state = SimpleNamespace(
                inner_forward=module.forward,
                prior_forward=module.__dict__.get("forward"),
                active=True,
                serve=_embedding_rows if served.kind == "rows" else _head_tiles,
                vocab=self,
                served=served,
            )
            install_forward(module, _KEY, state, _served_forward)
        self.served = wanted

    def stop(self) -> None:
        """Every module back to its own forward (detach)."""
        self.serve(())
        self._pinned_rows = None

    @staticmethod
    def _restore(module: nn.Module) -> None:
        remove_forward(module, _KEY)

    def host_weight(self, served: ServedChunk) -> torch.Tensor:
        """The weight in the host store."""
        return slot_view(self.manager.host.view(served.chunk.index), served.chunk.slots[0])

    def pinned_rows(self) -> _PinnedRows:
        if self._pinned_rows is None:
            self._pinned_rows = _PinnedRows(self.manager.is_cuda)
        return self._pinned_rows


def _served_forward(state: SimpleNamespace, args: tuple, kwargs: dict) -> torch.Tensor:
    """The module's forward while served (``forward_wrap``): its own once it is no longer."""
    if not state.active:
        return state.inner_forward(*args, **kwargs)
    return state.serve(state.vocab, state.served, *args, **kwargs)


def served_head_pass(
    module: nn.Module,
) -> Callable[[], Callable[[torch.Tensor], torch.Tensor]] | None:
    """While ``module`` is a served head, a function that brings its whole weight to the device
    for one pass of a head fused with the loss (``activations/fused_head.py``) and returns
    ``rows -> module(rows)`` computed from it, in the dtype the served forward uses; else None.
    The fused loss reads the head once per chunk of rows: streaming its tiles for each would
    copy it in a thousand times at 500K tokens, where the whole weight (1.05 GB for Llama-3) is
    small beside the rows' activations."""
    state = module.__dict__.get(_KEY)
    if state is None or not state.active or state.served.kind == "rows":
        return None
    vocab, served = state.vocab, state.served

    def one_pass() -> Callable[[torch.Tensor], torch.Tensor]:
        host = vocab.host_weight(served)
        weight = host.to(vocab.manager.device, non_blocking=True)
        vocab.manager.stats["h2d_bytes"] += host.numel() * host.element_size()

        def logits(rows: torch.Tensor) -> torch.Tensor:
            dtype = _compute_dtype(rows, weight)
            with torch.autocast(rows.device.type, enabled=False):
                return F.linear(rows.to(dtype), weight.to(dtype))

        return logits

    return one_pass


class _PinnedRows:
    """A reusable pinned host buffer for gathered rows; reuse waits for its last copy."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.buffer: torch.Tensor | None = None
        self.done: torch.cuda.Event | None = None

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self.done is not None:
            self.done.synchronize()  # the previous rows' copy still reads the buffer
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if self.buffer is None or self.buffer.numel() < nbytes:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        return self.buffer[:nbytes].view(dtype)


def _embedding_rows(vocab: HostVocab, served: ServedChunk, ids: torch.Tensor) -> torch.Tensor:
    """``F.embedding(ids, weight)`` from the host store: only the indexed rows are copied in
    (the padding index, ``scale_grad_by_freq`` and ``sparse`` shape only a trained embedding's
    gradient)."""
    device = vocab.manager.device
    weight = vocab.host_weight(served)
    host_ids = ids.to("cpu").reshape(-1)
    dim = weight.shape[1:]
    if device.type != "cuda":
        rows = weight.index_select(0, host_ids)
        return rows.to(device, copy=True).view(*ids.shape, *dim)
    pinned = vocab.pinned_rows()
    staging = pinned.take(host_ids.numel() * dim.numel(), weight.dtype).view(-1, *dim)
    torch.index_select(weight, 0, host_ids, out=staging)
    rows = staging.to(device, non_blocking=True)
    pinned.done = torch.cuda.Event()
    pinned.done.record(torch.cuda.current_stream(device))
    return rows.view(*ids.shape, *dim)


def _head_tiles(vocab: HostVocab, served: ServedChunk, x: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` from the host store, one vocabulary tile at a time."""
    return _TiledHead.apply(x, vocab, served)


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear`` computes in: autocast's where it is on, else the input's."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


def _tiles(vocab: HostVocab, served: ServedChunk, dtype: torch.dtype):
    """Yield (start, stop, tile on the device) over the head's rows, each tile's copy started
    one tile ahead on the chunk store's H2D stream."""
    manager = vocab.manager
    weight = vocab.host_weight(served)
    rows, step = weight.shape[0], served.tile_rows()
    spans = [(start, min(rows, start + step)) for start in range(0, rows, step)]
    if not manager.is_cuda:
        for start, stop in spans:
            yield start, stop, weight[start:stop].to(manager.device, dtype=dtype, copy=True)
        return
    compute = torch.cuda.current_stream(manager.device)

    def start_copy(span: tuple[int, int]) -> tuple[torch.Tensor, torch.cuda.Event]:
        # Allocated on the compute stream (its pool reuses a tile freed there at once); the
        # copy waits for the compute queued so far, which includes the last reader of that
        # memory.
        tile = torch.empty(
            (span[1] - span[0], *weight.shape[1:]), dtype=weight.dtype, device=manager.device
        )
        manager.h2d_stream.wait_stream(compute)
        with torch.cuda.stream(manager.h2d_stream):
            tile.copy_(weight[span[0] : span[1]], non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(manager.h2d_stream)
        manager.stats["h2d_bytes"] += tile.numel() * tile.element_size()
        return tile, ready

    pending = start_copy(spans[0])
    for position, (start, stop) in enumerate(spans):
        tile, ready = pending
        if position + 1 < len(spans):
            pending = start_copy(spans[position + 1])
        compute.wait_event(ready)
        yield start, stop, tile.to(dtype)
        del tile


class _TiledHead(torch.autograd.Function):
    """``x @ weight.T`` with the frozen weight in the host store, tile by tile both ways."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, vocab: HostVocab, served: ServedChunk) -> torch.Tensor:
        weight = vocab.host_weight(served)
        dtype = _compute_dtype(x, weight)
        ctx.vocab, ctx.served, ctx.dtype, ctx.x_dtype = vocab, served, dtype, x.dtype
        xc = x.to(dtype)
        out = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=dtype, device=x.device)
        with torch.autocast(x.device.type, enabled=False):
            for start, stop, tile in _tiles(vocab, served, dtype):
                out[..., start:stop] = F.linear(xc, tile)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        grad = grad.to(ctx.dtype)
        total = torch.zeros(
            (*grad.shape[:-1], ctx.served.weight_shape[1]), dtype=torch.float32, device=grad.device
        )
        for start, stop, tile in _tiles(ctx.vocab, ctx.served, ctx.dtype):
            total += grad[..., start:stop] @ tile
        return total.to(ctx.x_dtype), None, None
