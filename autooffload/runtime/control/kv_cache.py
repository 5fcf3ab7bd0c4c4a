"""Rewinding the KV caches that a failed forward already extended, so that the OOM retry can run
the forward again (``generate``'s decoding steps hand the model a transformers ``Cache``).

A forward appends each layer's keys and values to the cache it is given as it reaches that
layer; a forward that runs out of memory part-way leaves the first layers extended. Run again
as it is, those layers would hold the new tokens twice. Only the layer kinds whose update is
known exactly are rewound: a dynamic layer (keys and values grown by concatenation: cut back to
their old length) and a static one (written in place at a running position: the position is
set back). Any other cache (sliding windows, quantized or linear-attention layers, an
encoder-decoder pair) is not retried.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_DYNAMIC = "DynamicLayer"
_STATIC = "StaticLayer"


def _is_cache(value: Any) -> bool:
    return any(
        cls.__name__ == "Cache" and cls.__module__.startswith("transformers.")
        for cls in type(value).__mro__
    )


@dataclass
class _LayerMark:
    """One cache layer's state before the forward: its length, or its write position."""

    layer: Any
    length: int
    position: torch.Tensor | int | None


@dataclass
class _CacheMark:
    """One cache before the forward: how many layers it had (a cache made without a config
    adds its layers at their first update) and each one's state."""

    cache: Any
    n_layers: int
    layers: list[_LayerMark]


@dataclass
class CacheRewind:
    """The KV caches among a forward's inputs, marked before it runs."""

    caches: list[_CacheMark]
    # Names of the cache classes that cannot be rewound; empty when every cache can be.
    unsupported: list[str]

    @classmethod
    def mark(cls, inputs: list[Any]) -> CacheRewind | None:
        """Mark the caches among a forward's flattened ``inputs`` (``tree_flatten((args,
        kwargs))``'s leaves); None when the forward is given none."""
        caches = [v for v in inputs if _is_cache(v)]
        if not caches:
            return None
        marks, unsupported = [], []
        for cache in caches:
            if _rewindable(cache):
                layers = [_mark_layer(layer) for layer in cache.layers]
                marks.append(_CacheMark(cache, len(cache.layers), layers))
            else:
                unsupported.append(type(cache).__name__)
        return cls(marks, unsupported)

    def rewind(self) -> None:
        """Put every marked cache back to its state before the forward."""
        for mark in self.caches:
            del mark.cache.layers[mark.n_layers :]
            for layer_mark in mark.layers:
                _rewind_layer(layer_mark)


def _rewindable(cache: Any) -> bool:
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or getattr(cache, "offloading", False):
        return False
    kinds = {type(layer).__name__ for layer in layers}
    added = getattr(cache, "layer_class_to_replicate", None)
    if added is not None:
        kinds.add(added.__name__)
    return kinds <= {_DYNAMIC, _STATIC}


def _mark_layer(layer: Any) -> _LayerMark:
    position = getattr(layer, "cumulative_length", None)
    if isinstance(position, torch.Tensor):
        position = position.clone()
    return _LayerMark(layer, layer.get_seq_length(), position)


def _rewind_layer(mark: _LayerMark) -> None:
    layer = mark.layer
    if type(layer).__name__ == _STATIC:
        if isinstance(mark.position, torch.Tensor):
            layer.cumulative_length.copy_(mark.position)
        elif mark.position is not None:
            layer.cumulative_length = mark.position
    elif getattr(layer, "is_initialized", False) and layer.keys is not None:
        layer.keys = layer.keys[..., : mark.length, :]
        layer.values = layer.values[..., : mark.length, :]
