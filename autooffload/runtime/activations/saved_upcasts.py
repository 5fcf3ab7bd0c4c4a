"""Saved upcasts kept as their low-precision source.

PEFT casts a LoRA layer's input to its adapter's dtype before ``lora_A`` (a bf16 base with fp32
adapters: an fp32 copy of the input), and ``lora_A`` saves that copy for its weight gradient:
twice the input's bytes, once per LoRA layer that reads the input (a decoder layer's q, k and v
projections read the same one: three fp32 copies; gate and up: two). Inside
``saving_sources()``, a tensor registered with ``register(upcast, source)`` is saved as its
source and cast again when the backward unpacks it. A widening float cast is exact, so the
unpacked tensor equals the upcast bit for bit; the autograd graph is the one plain training
builds, so the gradients are too. What stays saved is the source, once however many layers
upcast it.

The saved-tensor hooks active outside (a block's swap to host memory, a checkpoint, the
profiler's count of saved bytes) get the source where the upcast was saved, every other tensor
as before. Without outer hooks a saved tensor is kept as it is, and modifying it in place before
the backward raises, as plain autograd does.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

# Widening float casts: every value of the source is exactly representable in the target.
_WIDER = {
    torch.bfloat16: (torch.float32, torch.float64),
    torch.float16: (torch.float32, torch.float64),
    torch.float32: (torch.float64,),
}

_state = threading.local()


def is_exact_upcast(source: torch.Tensor, upcast: torch.Tensor) -> bool:
    """Whether ``upcast`` can be remade exactly from ``source`` by ``source.to(upcast.dtype)``
    (both contiguous, as a cast of a contiguous tensor is)."""
    return (
        upcast.dtype in _WIDER.get(source.dtype, ())
        and upcast.shape == source.shape
        and upcast.device == source.device
        and upcast.is_contiguous()
        and source.is_contiguous()
    )


class _Frame:
    """One ``saving_sources()`` scope: its registered upcasts, and its hooks once the first
    one is registered (saved tensors before it are saved as always). ``sources``: by the
    upcast's storage address, the upcast (held weakly: the address is its while it lives) and
    its source."""

    __slots__ = ("sources", "hooks")

    def __init__(self) -> None:
        self.sources: dict[int, tuple[weakref.ref, torch.Tensor]] | None = None
        self.hooks: Any = None


def register(upcast: torch.Tensor, source: torch.Tensor) -> None:
    """Inside ``saving_sources()``: save ``upcast`` (``source.to(wider dtype)``, fresh) as
    ``source`` from now to the scope's end. Outside one, or for a cast that is not an exact
    widening, nothing."""
    stack: list[_Frame] | None = getattr(_state, "stack", None)
    if not stack or upcast is source or not is_exact_upcast(source, upcast):
        return
    frame = stack[-1]
    if frame.sources is None:
        frame.sources = {}
        frame.hooks = _hooks(frame.sources)
        frame.hooks.__enter__()
    frame.sources[upcast.untyped_storage().data_ptr()] = (weakref.ref(upcast), source)


@contextmanager
def saving_sources() -> Iterator[None]:
    """A scope (a PEFT layer's forward) whose ``register``-ed upcasts are saved as their
    sources (see the module docstring)."""
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    frame = _Frame()
    stack.append(frame)
    try:
        yield
    finally:
        stack.pop()
        if frame.hooks is not None:
            frame.hooks.__exit__(None, None, None)
            # Every tensor saved under the hooks keeps their unpack hook, and with it this
            # table, until the backward: the sources it holds go now (a source saved for the
            # backward is held by what the outer hooks packed, or by its ``_Source``). Held on,
            # a checkpointed block's LoRA inputs would stay on the device until its backward
            # (Llama-3-8B at seq 98304: ~2.3 GiB a block).
            frame.sources.clear()


class _Source:
    """A saved upcast: its source as the outer hooks packed it (or itself), the dtype to cast
    it to, and the source's version when it is kept as it is."""

    __slots__ = ("packed", "dtype", "version", "shape")

    def __init__(
        self, packed: Any, dtype: torch.dtype, version: int | None, shape: torch.Size
    ) -> None:
        self.packed = packed
        self.dtype = dtype
        self.version = version
        self.shape = shape


class _Kept:
    """A saved tensor kept as it is (no outer hooks), with its version at saving. Held
    detached (the same storage and version counter; autograd puts the saved tensor's graph
    back on unpack): a saved output held with its ``grad_fn`` would make a cycle through
    autograd's C++ nodes that nothing frees where no backward runs."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach()
        self.version = tensor._version


def _check_version(tensor: torch.Tensor, version: int) -> torch.Tensor:
    if tensor._version != version:
        raise RuntimeError(
            "autooffload: a tensor saved for the backward inside a PEFT layer's forward (or the"
            " input a LoRA layer upcast) was modified by an in-place operation before the"
            f" backward (version {version} -> {tensor._version}); make that operation out of"
            " place, or set AUTOOFFLOAD_SAVED_UPCASTS=0"
        )
    return tensor


def _source_of(
    sources: dict[int, tuple[weakref.ref, torch.Tensor]], tensor: torch.Tensor
) -> torch.Tensor | None:
    """The source of ``tensor`` where it is a registered upcast or a whole contiguous view of
    one (a linear saves its 3-d input flattened to 2-d), else None."""
    entry = sources.get(tensor.untyped_storage().data_ptr())
    if entry is None:
        return None
    upcast = entry[0]()
    if (
        upcast is None
        or tensor.dtype != upcast.dtype
        or tensor.numel() != upcast.numel()
        or tensor.storage_offset() != upcast.storage_offset()
        or not tensor.is_contiguous()
    ):
        return None
    return entry[1]


def _hooks(
    sources: dict[int, tuple[weakref.ref, torch.Tensor]],
) -> torch.autograd.graph.saved_tensors_hooks:
    """Saved-tensor hooks that save each registered upcast in ``sources`` (or a whole view of
    it) as its source, composed with the hooks active now."""
    outer: tuple[Callable, Callable] | None = torch._C._autograd._top_saved_tensors_default_hooks(
        False
    )

    def pack(tensor: torch.Tensor) -> Any:
        source = _source_of(sources, tensor)
        if source is None:
            return outer[0](tensor) if outer is not None else _Kept(tensor)
        if outer is not None:
            return _Source(outer[0](source), tensor.dtype, None, tensor.shape)
        return _Source(source.detach(), tensor.dtype, source._version, tensor.shape)

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, _Source):
            source = outer[1](packed.packed) if outer is not None else packed.packed
            if packed.version is not None:
                _check_version(source, packed.version)
            return source.to(packed.dtype).reshape(packed.shape)
        if isinstance(packed, _Kept):
            return _check_version(packed.tensor, packed.version)
        return outer[1](packed) if outer is not None else packed

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
