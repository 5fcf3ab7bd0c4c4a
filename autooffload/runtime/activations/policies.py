"""Per-block activation policies: keep, checkpoint, swap to host memory, or checkpoint from host.

A transformer block saves tensors for its backward ("activations"). Each block gets one policy:

* ``keep``: plain autograd; nothing is installed.
* ``checkpoint``: non-reentrant :func:`torch.utils.checkpoint.checkpoint`; only the block input is
  kept and the block's forward is re-run inside its backward (RNG state restored, so dropout
  draws the same mask).
* ``swap``: every saved tensor of at least ``min_swap_bytes`` is copied to host memory during the
  forward and copied back before the block's backward needs it (:class:`ActivationSwapper`).
* ``checkpoint_cpu``: ``checkpoint`` whose one saved tensor, the block input, is itself swapped,
  so a checkpointed block keeps nothing large on the device.

The policy is a wrapper around ``block.forward`` (an instance attribute, removed exactly by
:func:`remove_policy`). It runs inside ``nn.Module.__call__``, so hooks registered on the block
fire once around it and are never re-run by a recompute. A recompute runs inside the block's
backward; while it runs, :func:`is_recomputing` is true in that thread and the optional
``on_recompute_start(block)`` callback has been called, so hooks on sub-modules can tell a
recompute from a first forward.

The swap protocol is described in :mod:`autooffload.runtime.activations.swap`.

Nesting: a swap block entered while other saved-tensor hooks are active (an outer
``torch.utils.checkpoint``, ``save_on_cpu``, or a checkpoint's recompute) runs as ``keep``: the
outer hooks already own those tensors. Inside a swap block, a ``torch.utils.checkpoint`` of the
user's own keeps working: its saved inputs are swapped, the tensors it recomputes are not.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from autooffload.errors import PlanError
from autooffload.log import logger
from autooffload.runtime.activations.swap import (  # noqa: F401 - re-exported
    DEFAULT_MIN_SWAP_BYTES,
    ActivationSwapper,
    HostBufferPool,
    _outer_hooks_active,
)
from autooffload.runtime.forward_wrap import install_forward, remove_forward

Policy = Literal["keep", "checkpoint", "swap", "checkpoint_cpu"]
POLICIES: tuple[str, ...] = ("keep", "checkpoint", "swap", "checkpoint_cpu")

_POLICY_ATTR = "_autooffload_activation_policy"
_HF_ATTR = "_autooffload_hf_checkpointing"
_recompute_state = threading.local()
_MISSING = object()


# --------------------------------------------------------------------------- recompute flag


def is_recomputing() -> bool:
    """True while a checkpointed block (or a tiled MLP) re-runs its forward inside backward."""
    return getattr(_recompute_state, "module", None) is not None


class recomputing:  # noqa: N801 - used like the context-manager function it replaced
    """Mark this thread as recomputing ``module``'s forward (calls ``on_start(module)`` first).

    Re-enterable: torch's checkpoint builds its recompute context once per forward and enters
    it at every recompute, and a graph kept with ``retain_graph=True`` is recomputed once per
    backward through it."""

    def __init__(
        self, module: nn.Module, on_start: Callable[[nn.Module], None] | None = None
    ) -> None:
        self.module = module
        self.on_start = on_start
        self._previous: list[nn.Module | None] = []
        self._frozen: list[contextlib.AbstractContextManager[None]] = []

    def __enter__(self) -> None:
        if self.on_start is not None:
            self.on_start(self.module)
        self._previous.append(getattr(_recompute_state, "module", None))
        self._frozen.append(running_stats_frozen(self.module))
        self._frozen[-1].__enter__()
        _recompute_state.module = self.module

    def __exit__(self, *exc: object) -> None:
        _recompute_state.module = self._previous.pop()
        self._frozen.pop().__exit__(*exc)


@contextlib.contextmanager
def running_stats_frozen(module: nn.Module) -> Iterator[None]:
    """Run ``module`` again with its batch norms' running statistics left as they were before:
    the forward that ran first updated them, as plain training does once per forward. Their
    running buffers are restored afterwards (not withheld: the norm saves them for its
    backward, and a recompute must save what the first forward saved)."""
    buffers = [
        buffer
        for m in module.modules()
        if isinstance(m, _BatchNorm) and m.training and m.track_running_stats
        for buffer in (m.running_mean, m.running_var, m.num_batches_tracked)
        if buffer is not None
    ]
    saved = [buffer.clone() for buffer in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(buffers, saved, strict=True):
                buffer.copy_(value)


# --------------------------------------------------------------------------- block policies


@dataclass(eq=False)
class BlockActivationPolicy:
    """What :func:`apply_policy` installed on one block; :func:`remove_policy` undoes it."""

    block: nn.Module
    policy: str
    swapper: ActivationSwapper | None
    block_index: int
    on_recompute_start: Callable[[nn.Module], None] | None
    inner_forward: Callable[..., Any]
    prior_forward: Callable[..., Any] | None
    wrapper: Callable[..., Any] | None = None
    active: bool = True


def apply_policy(
    block: nn.Module,
    policy: Policy,
    swapper: ActivationSwapper | None = None,
    *,
    block_index: int | None = None,
    on_recompute_start: Callable[[nn.Module], None] | None = None,
) -> None:
    """Give ``block`` the activation ``policy`` (replacing any earlier one).

    ``swap`` and ``checkpoint_cpu`` need ``swapper``; ``block_index`` orders blocks for
    ``swapper.prefetch`` (default: the order blocks are first seen by the swapper).
    ``on_recompute_start(block)`` is called when a checkpointed block starts its recompute.
    """
    if policy not in POLICIES:
        raise PlanError(
            f"activation policy {policy!r} for {type(block).__name__} is not one of {POLICIES}"
        )
    if policy in ("swap", "checkpoint_cpu") and swapper is None:
        raise PlanError(f"activation policy {policy!r} needs an ActivationSwapper; pass swapper=")
    remove_policy(block)
    if policy == "keep":
        return
    if block_index is None:
        block_index = swapper.index_for(block) if swapper is not None else -1
    state = BlockActivationPolicy(
        block=block,
        policy=policy,
        swapper=swapper,
        block_index=block_index,
        on_recompute_start=on_recompute_start,
        inner_forward=block.forward,
        prior_forward=block.__dict__.get("forward"),
    )
    install_forward(block, _POLICY_ATTR, state, _run_block)


def keep_checkpoint_input_on_host(block: nn.Module, swapper: ActivationSwapper) -> bool:
    """Turn ``block``'s ``checkpoint`` policy into ``checkpoint_cpu`` in place, so that a call
    already entered (its forward was looked up before its hooks ran) takes it too; False when
    the block has another policy."""
    state = block.__dict__.get(_POLICY_ATTR)
    if state is None or state.policy != "checkpoint":
        return False
    state.policy, state.swapper = "checkpoint_cpu", swapper
    return True


def remove_policy(block: nn.Module) -> None:
    """Undo :func:`apply_policy`: ``block.forward`` is again what it was before."""
    remove_forward(block, _POLICY_ATTR)


def policy_of(block: nn.Module) -> str:
    """The activation policy installed on ``block`` ("keep" when none)."""
    state = block.__dict__.get(_POLICY_ATTR)
    return "keep" if state is None else state.policy


def _run_block(state: BlockActivationPolicy, args: tuple, kwargs: dict) -> Any:
    inner = state.inner_forward
    if not state.active or not torch.is_grad_enabled():
        return inner(*args, **kwargs)
    block, swapper = state.block, state.swapper
    if state.policy == "swap":
        if _outer_hooks_active():
            swapper.counters["nested_skips"] += 1
            return inner(*args, **kwargs)
        if block.training:
            args, kwargs = _without_cache(block, args, kwargs)
        with swapper.saving(state.block_index, _params_and_buffers(block)):
            return inner(*args, **kwargs)

    def recompute_contexts() -> tuple[contextlib.AbstractContextManager, ...]:
        return contextlib.nullcontext(), recomputing(block, state.on_recompute_start)

    args, kwargs = _without_cache(block, args, kwargs)
    # kwargs go in a partial so none can collide with checkpoint's own keyword arguments.
    run = functools.partial(
        checkpoint,
        functools.partial(inner, **kwargs),
        *args,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=recompute_contexts,
    )
    if state.policy == "checkpoint_cpu" and not _outer_hooks_active():
        with swapper.saving(state.block_index):
            return run()
    return run()


def _params_and_buffers(block: nn.Module) -> Iterator[torch.Tensor]:
    yield from block.parameters()
    yield from block.buffers()


# The names a block's KV cache is passed under: ``cache`` since transformers 5.24 (HF's own
# checkpointing layer clears it under that name), ``past_key_values`` / ``past_key_value``
# before, ``layer_past`` in older architectures.
KV_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def is_kv_cache(name: str, value: Any) -> bool:
    """Whether keyword argument ``name=value`` of a block call is a KV cache: one of the names
    above, or any value of a transformers ``Cache`` class (whatever a model calls it; ``name``
    empty for a positional argument, as GPT-2 passes its cache)."""
    if value is None:
        return False
    if name in KV_CACHE_KWARGS:
        return True
    cache_utils = sys.modules.get("transformers.cache_utils")
    cache_class = getattr(cache_utils, "Cache", None)
    return cache_class is not None and isinstance(value, cache_class)


def _refuse_filled_cache(block: nn.Module, where: str, value: Any) -> None:
    """A cache holding states before the block runs (PEFT prefix tuning hands the trained prefix
    in as ``past_key_values``) is part of the input: dropping it changes the result."""
    seq_length = getattr(value, "get_seq_length", None)
    if not callable(seq_length):
        return
    try:
        filled = seq_length() > 0
    except Exception:  # a cache type whose length cannot be read here is dropped as before
        return
    if filled:
        raise PlanError(
            f"{type(block).__name__} got a filled KV cache ({where}) in a training forward (PEFT"
            " prefix tuning passes its prefix this way); its blocks cannot be checkpointed or"
            " swapped, since a recompute would append to the cache again. Set"
            " AUTOOFFLOAD_ACTIVATION_MODE=keep (enable(activation_mode='keep'))"
        )


def positional_kv_caches(args: tuple) -> list[int]:
    """Positions of the transformers ``Cache`` objects among a block call's ``args``."""
    return [i for i, value in enumerate(args) if is_kv_cache("", value)]


def _without_cache(block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # As HF's own checkpointing does: a recompute would append to a KV cache a second time, and a
    # cache holding device K/V would pin swapped activations on the device.
    changed = dict(kwargs)
    if changed.get("use_cache"):
        changed["use_cache"] = False
    changed_args = list(args)
    caches: list[int] = []
    if not getattr(block, "_can_checkpoint_with_cache", False):
        for name, value in kwargs.items():
            if is_kv_cache(name, value):
                _refuse_filled_cache(block, f"{name}=", value)
                changed[name] = None
        caches = positional_kv_caches(args)
        for position in caches:
            _refuse_filled_cache(block, f"positional argument {position}", args[position])
            changed_args[position] = None
    if caches or changed != kwargs:
        logger.debug("%s: KV cache disabled for a training forward", type(block).__name__)
    return tuple(changed_args), changed


# --------------------------------------------------------------------------- HF checkpointing


def take_over_hf_gradient_checkpointing(model: nn.Module) -> bool:
    """Turn off HF's per-layer gradient checkpointing so autooffload's policy is the only one.

    Returns whether any module had it on (the caller logs that once). The modules HF had
    checkpointing on for are kept; :func:`hf_checkpointed_modules` lists them and
    :func:`restore_hf_gradient_checkpointing` turns them back on.
    """
    flagged = [m for m in model.modules() if getattr(m, "gradient_checkpointing", None) is True]
    if not flagged:
        return False
    previous = model.__dict__.get(_HF_ATTR, [])
    for module in flagged:
        previous.append((module, module.__dict__.get("gradient_checkpointing", _MISSING)))
        module.gradient_checkpointing = False
    model.__dict__[_HF_ATTR] = previous
    return True


def hf_checkpointed_modules(model: nn.Module) -> tuple[nn.Module, ...]:
    """The modules HF had gradient checkpointing on for before it was taken over."""
    return tuple(module for module, _ in model.__dict__.get(_HF_ATTR, ()))


def restore_hf_gradient_checkpointing(model: nn.Module) -> None:
    """Undo :func:`take_over_hf_gradient_checkpointing`."""
    for module, value in reversed(model.__dict__.pop(_HF_ATTR, [])):
        if value is _MISSING:
            module.__dict__.pop("gradient_checkpointing", None)
        else:
            module.gradient_checkpointing = value
