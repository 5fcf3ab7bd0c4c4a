"""Device access to chunked parameters outside their group's forward (PEFT merges, adapter init)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

import torch

from autooffload.runtime import registry
from autooffload.runtime.chunks.layout import Chunk, ParamSlot
from autooffload.runtime.chunks.store import Residency

if TYPE_CHECKING:
    from autooffload.runtime.runtime import Runtime

T = TypeVar("T")


def runtime_managing(params: Iterable[torch.Tensor]) -> Runtime | None:
    """The runtime whose chunks hold any of ``params``, if any."""
    candidates = registry.runtimes()
    if not candidates:
        return None
    params = list(params)
    for runtime in candidates:
        if any(runtime.owns(p) for p in params):
            return runtime
    return None


def call_detached(runtime: Runtime, refusal: str, call: Callable[[], T]) -> T:
    """``call()`` with ``runtime``'s model detached to the host, attached again after it on the
    same device with the same settings (the plan is searched anew at its next forward): for
    library calls that rebuild parameters from their values (``resize_token_embeddings``,
    ``prepare_model_for_kbit_training``). Raises ``AttachError(refusal)`` once an optimizer
    holds the model's parameters, whose data the call replaces."""
    from autooffload import runtime as rt
    from autooffload.errors import AttachError

    if runtime.optimizers:
        raise AttachError(refusal)
    attached, device, settings = runtime.model, runtime.device, runtime.settings
    rt.detach(attached, torch.device("cpu"))
    try:
        return call()
    finally:
        rt.attach(attached, settings=settings, device=device)


def _device_view(runtime: Runtime, chunk: Chunk, slot: ParamSlot) -> torch.Tensor:
    flat = runtime.manager.gpu_flat[chunk.index]
    return flat[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)


def _store(runtime: Runtime, chunk: Chunk, slot: ParamSlot) -> None:
    """Put a param written on the device back into its chunk, and into the host store where
    that is the copy the next gather reads (every non-persistent chunk)."""
    manager = runtime.manager
    param = slot.param
    view = _device_view(runtime, chunk, slot)
    if param.data.data_ptr() != view.data_ptr():
        # ``weight.data = new_tensor`` (PEFT's safe merge, DoRA unmerge) left the chunk: the new
        # bytes go into the chunk and the param becomes a view of it again.
        view.copy_(param.data)
        param.data = view
    if chunk.index in manager.persistent or not manager.hosts(chunk.index):
        return  # another rank's chunk: its owner stores the same change
    busy = manager.host_busy.get(chunk.index)
    if busy is not None:
        busy.result()
    manager.before_host_write(chunk.index)
    manager.host_view(slot, chunk).copy_(view)


@contextmanager
def params_on_device(
    runtime: Runtime,
    params: Iterable[torch.Tensor],
    written: Iterable[torch.Tensor] = (),
) -> Iterator[None]:
    """Keep the chunks holding ``params`` on the device for the block, through any release
    (a group hook inside it included); release at exit those that were not resident before.
    Params in ``written`` may be changed on the device inside the block (in place, or by
    replacing ``.data``); their bytes are stored back at exit, so the change survives the
    release. Nested use is cheap: chunks already resident are left where they are."""
    slot_of = runtime.slot_index
    manager = runtime.manager
    indices = sorted({slot_of[id(p)][0].index for p in params if id(p) in slot_of})
    fetched = [i for i in indices if manager.state[i] != Residency.RESIDENT]
    for index in indices:
        manager.gather(index)
        manager.hold(index)
    try:
        yield
    finally:
        try:
            for param in dict.fromkeys(written):
                entry = slot_of.get(id(param))
                if entry is not None:
                    _store(runtime, *entry)
        finally:
            for index in indices:
                manager.unhold(index)
            for index in fetched:
                manager.release(index)
