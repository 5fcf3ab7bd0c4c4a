"""Tiled MLP: run a token-wise MLP over token tiles so its intermediate activations stay bounded.

An MLP such as HF ``LlamaMLP`` (``down(act(gate(x)) * up(x))``) holds ``tokens x intermediate``
activations, several times the hidden state, for its backward. :func:`tile_mlp` makes its
forward a custom autograd function (the idea of Arctic Long Sequence Training's TiledMLP):

* forward: the flattened tokens are split into tiles of ``tile_tokens``; each tile runs under
  ``no_grad`` and writes its slice of the output; only the input is saved.
* backward: tile by tile, the tile's forward is re-run with grad enabled (same autocast state,
  RNG state restored) and differentiated with the tile's slice of the output gradient; input
  gradients are written per tile, parameter gradients summed over tiles and returned to autograd
  (so gradient hooks and accumulation happen once, as for the untiled MLP).

Peak MLP memory is one tile's intermediates instead of the whole sequence's. Gradients equal the
untiled ones up to summation order. The recompute runs with
:func:`autooffload.runtime.activations.policies.is_recomputing` true. Only for MLPs that treat every
token independently (not capacity-routed MoE) and whose ``forward(x)`` returns one tensor; with
dropout inside the MLP the masks are drawn per tile, so they differ from the untiled ones.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autooffload.errors import PlanError
from autooffload.runtime.activations.policies import recomputing
from autooffload.runtime.forward_wrap import install_forward, remove_forward

_TILED_ATTR = "_autooffload_tiled_mlp"
# Attributes of mixture-of-experts MLPs: their routing (capacity, load balancing) sees every
# token of the batch at once, so a tile would route differently.
_ROUTED_ATTRS = ("experts", "router", "gate_network", "num_experts")

logger = logging.getLogger("autooffload")


@dataclass(eq=False)
class TiledMLP:
    """What :func:`tile_mlp` installed on one MLP; :func:`untile_mlp` undoes it."""

    mlp: nn.Module
    tile_tokens: int
    min_tokens: int
    inner_forward: Callable[..., Any]
    prior_forward: Callable[..., Any] | None
    wrapper: Callable[..., Any] | None = None
    active: bool = True


def tile_mlp(mlp: nn.Module, tile_tokens: int, min_tokens: int | None = None) -> None:
    """Run ``mlp`` in tiles of ``tile_tokens`` tokens when its input has more than ``min_tokens``.

    ``min_tokens`` defaults to ``tile_tokens`` (tile only when there are at least two tiles).
    Calling it again replaces the earlier tiling.
    """
    if tile_tokens < 1:
        raise PlanError(f"tile_tokens for {type(mlp).__name__} is {tile_tokens}; use an int >= 1")
    untile_mlp(mlp)
    state = TiledMLP(
        mlp=mlp,
        tile_tokens=tile_tokens,
        min_tokens=tile_tokens if min_tokens is None else min_tokens,
        inner_forward=mlp.forward,
        prior_forward=mlp.__dict__.get("forward"),
    )
    install_forward(mlp, _TILED_ATTR, state, _run_mlp)


def untile_mlp(mlp: nn.Module) -> None:
    """Undo :func:`tile_mlp`: ``mlp.forward`` is again what it was before."""
    remove_forward(mlp, _TILED_ATTR)


def is_tiled(mlp: nn.Module) -> bool:
    """Whether :func:`tile_mlp` is installed on ``mlp``."""
    return _TILED_ATTR in mlp.__dict__


def find_mlp(block: nn.Module) -> nn.Module | None:
    """The token-wise MLP of a decoder block, or None: the block's ``mlp`` attribute (Hugging
    Face decoder layers) whose ``forward`` takes one required input; routed (mixture-of-experts)
    MLPs are skipped, with a DEBUG line."""
    mlp = getattr(block, "mlp", None)
    if not isinstance(mlp, nn.Module):
        return None
    if any(hasattr(mlp, name) for name in _ROUTED_ATTRS):
        logger.debug("%s.mlp is routed (mixture of experts): not tiled", type(block).__name__)
        return None
    try:
        params = list(inspect.signature(mlp.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    required = [
        p
        for p in params
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if len(required) != 1:
        logger.debug(
            "%s.mlp.forward takes %d required inputs: not tiled",
            type(block).__name__,
            len(required),
        )
        return None
    return mlp


def tile_tokens_of(mlp: nn.Module | None) -> int:
    """The tile size :func:`tile_mlp` installed on ``mlp``; 0 when it is not tiled."""
    state = None if mlp is None else mlp.__dict__.get(_TILED_ATTR)
    return 0 if state is None or not state.active else state.tile_tokens


def find_norms(block: nn.Module) -> list[nn.Module]:
    """The block's own token-wise norms (its direct children named like ``*Norm``, or torch's
    ``LayerNorm`` / ``RMSNorm``, whose ``forward`` takes one required input: a decoder layer's
    ``input_layernorm`` and ``post_attention_layernorm``). Tiled with the MLP: an RMSNorm in
    bf16 saves an fp32 copy of its input and more, ~5 hidden states per token per norm (Llama
    at 8K tokens and beyond, as much as the attention)."""
    norms = []
    for module in block.children():
        kind = type(module)
        if not (isinstance(module, nn.LayerNorm | nn.RMSNorm) or kind.__name__.endswith("Norm")):
            continue
        try:
            params = list(inspect.signature(module.forward).parameters.values())
        except (TypeError, ValueError):
            continue
        required = [
            p
            for p in params
            if p.default is inspect.Parameter.empty
            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        ]
        if len(required) == 1:
            norms.append(module)
    return norms


def find_final_norm(model: nn.Module) -> nn.Module | None:
    """The norm a causal LM applies before its head (``find_norms`` of its decoder, where that
    finds exactly one: Llama's ``model.norm``), or None."""
    from autooffload.runtime.activations.head_source import find_causal_lm

    causal_lm = find_causal_lm(model)
    if causal_lm is None:
        return None
    get_decoder = getattr(causal_lm, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else getattr(causal_lm, "model", None)
    if not isinstance(decoder, nn.Module):
        return None
    norms = find_norms(decoder)
    return norms[0] if len(norms) == 1 else None


def set_mlp_tiles(blocks: Iterable[nn.Module], tile_tokens: int) -> int:
    """Tile the MLP of every block (``find_mlp``), and the block's norms (``find_norms``), in
    tiles of ``tile_tokens`` tokens, or untile them all with 0; returns how many MLPs are
    tiled (a block without a tileable MLP keeps its norms untiled)."""
    tiled = 0
    for block in blocks:
        mlp = find_mlp(block)
        if mlp is None:
            continue
        for module in (mlp, *find_norms(block)):
            if tile_tokens <= 0:
                untile_mlp(module)
                continue
            state = module.__dict__.get(_TILED_ATTR)
            if state is None or state.tile_tokens != tile_tokens:
                tile_mlp(module, tile_tokens)
        if tile_tokens > 0:
            tiled += 1
    return tiled


def _run_mlp(state: TiledMLP, args: tuple, kwargs: dict) -> Any:
    inner = state.inner_forward
    if not state.active or kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
        return inner(*args, **kwargs)
    x = args[0]
    if x.dim() < 2 or x.numel() // x.shape[-1] <= state.min_tokens:
        return inner(x)
    if not torch.is_grad_enabled():
        return _tiled_forward(inner, x, state.tile_tokens)
    params = [p for p in state.mlp.parameters() if p.requires_grad]
    return _TiledMLPFunction.apply(inner, state.tile_tokens, state.mlp, x, *params)


def _tiled_forward(fn: Callable[..., Any], x: torch.Tensor, tile_tokens: int) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    out: torch.Tensor | None = None
    for start in range(0, flat.shape[0], tile_tokens):
        tile_out = fn(flat[start : start + tile_tokens])
        if out is None:
            out = tile_out.new_empty(flat.shape[0], *tile_out.shape[1:])
        out[start : start + tile_out.shape[0]] = tile_out
    return out.view(*x.shape[:-1], *out.shape[1:])


class _TiledMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: Callable, tile_tokens: int, mlp: nn.Module, x, *params):
        ctx.fn, ctx.tile_tokens, ctx.mlp, ctx.params = fn, tile_tokens, mlp, params
        device_type = x.device.type
        ctx.autocast = (
            device_type,
            torch.is_autocast_enabled(device_type),
            torch.get_autocast_dtype(device_type),
        )
        ctx.cpu_rng = torch.get_rng_state()
        ctx.device_rng = torch.cuda.get_rng_state(x.device) if device_type == "cuda" else None
        ctx.save_for_backward(x)
        return _tiled_forward(fn, x, tile_tokens)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        need_x = ctx.needs_input_grad[3]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[4:]) if need]
        grad_x = torch.empty_like(x) if need_x else None
        param_grads: list[torch.Tensor | None] = [None] * len(ctx.params)
        flat_x = x.reshape(-1, x.shape[-1])
        flat_grad_x = grad_x.view(-1, x.shape[-1]) if need_x else None
        flat_grad_out = grad_out.reshape(-1, *grad_out.shape[x.dim() - 1 :])
        device_type, autocast_on, autocast_dtype = ctx.autocast
        devices = [x.device] if ctx.device_rng is not None else []
        with (
            torch.random.fork_rng(devices=devices, device_type=device_type),
            torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on),
            recomputing(ctx.mlp),
        ):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.device_rng is not None:
                torch.cuda.set_rng_state(ctx.device_rng, x.device)
            for start in range(0, flat_x.shape[0], ctx.tile_tokens):
                stop = start + ctx.tile_tokens
                tile_x = flat_x[start:stop].detach().requires_grad_(need_x)
                with torch.enable_grad():
                    tile_out = ctx.fn(tile_x)
                inputs = ([tile_x] if need_x else []) + [ctx.params[i] for i in wanted]
                if not inputs:
                    continue
                grads = torch.autograd.grad(
                    tile_out, inputs, flat_grad_out[start:stop], allow_unused=True
                )
                if need_x:
                    flat_grad_x[start:stop] = grads[0]
                    grads = grads[1:]
                for i, grad in zip(wanted, grads):
                    if grad is None:
                        continue
                    if param_grads[i] is None:
                        param_grads[i] = grad
                    else:
                        param_grads[i] += grad
        return (None, None, None, grad_x, *param_grads)
