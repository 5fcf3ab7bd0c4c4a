"""Tiled MLP gives the untiled gradients with bounded intermediates, and untiles exactly."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from autooffload.errors import PlanError
from autooffload.runtime.activations.policies import apply_policy, is_recomputing
from autooffload.runtime.activations.tiled_mlp import (
    find_norms,
    is_tiled,
    set_mlp_tiles,
    tile_mlp,
    untile_mlp,
)
from tests.runtime.test_activations import assert_same_step, tiny_llama, train_step


def make_mlp() -> LlamaMLP:
    torch.manual_seed(0)
    return LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=96, hidden_act="silu"))


def mlp_step(mlp: LlamaMLP, autocast: bool = False):
    mlp.zero_grad(set_to_none=True)
    x = torch.randn(2, 37, 32, generator=torch.Generator().manual_seed(3), requires_grad=True)
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with amp:
        out = mlp(x)
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), [x.grad] + [p.grad for p in mlp.parameters()]


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast_bf16"])
def test_tiled_mlp_matches_untiled(autocast: bool) -> None:
    mlp = make_mlp()
    expected_out, expected_grads = mlp_step(mlp, autocast)
    tile_mlp(mlp, tile_tokens=16)  # 74 tokens: tiles of 16, 16, 16, 16, 10
    starts = []
    mlp.gate_proj.register_forward_pre_hook(
        lambda m, a: starts.append((a[0].shape[0], is_recomputing()))
    )
    out, grads = mlp_step(mlp, autocast)
    atol, rtol = (1e-2, 1e-2) if autocast else (1e-6, 1e-5)
    torch.testing.assert_close(out, expected_out, atol=atol, rtol=rtol)
    for e, a in zip(expected_grads, grads):
        torch.testing.assert_close(a, e, atol=atol, rtol=rtol)
    assert starts == [(16, False)] * 4 + [(10, False)] + [(16, True)] * 4 + [(10, True)]


def test_short_inputs_and_no_grad_are_handled() -> None:
    mlp = make_mlp()
    tile_mlp(mlp, tile_tokens=16, min_tokens=100)
    calls = []
    mlp.gate_proj.register_forward_pre_hook(lambda m, a: calls.append(a[0].shape))
    x = torch.randn(2, 37, 32)
    mlp(x)
    assert calls == [x.shape]  # 74 tokens <= min_tokens: untiled
    calls.clear()
    tile_mlp(mlp, tile_tokens=16, min_tokens=0)
    with torch.no_grad():
        tiled = mlp(x)
    untile_mlp(mlp)
    with torch.no_grad():
        torch.testing.assert_close(tiled, mlp(x), atol=1e-6, rtol=1e-5)
    assert len(calls) == 5 + 1


def test_untile_restores_forward() -> None:
    mlp = make_mlp()
    tile_mlp(mlp, tile_tokens=8)
    assert is_tiled(mlp) and "forward" in mlp.__dict__
    untile_mlp(mlp)
    assert not is_tiled(mlp) and "forward" not in mlp.__dict__
    assert mlp.forward.__func__ is LlamaMLP.forward
    with pytest.raises(PlanError, match="tile_tokens"):
        tile_mlp(mlp, tile_tokens=0)


@pytest.mark.parametrize("policy", ["keep", "checkpoint", "swap"])
def test_tiled_mlp_inside_a_llama_with_block_policies(policy: str) -> None:
    from autooffload.runtime.activations.policies import ActivationSwapper

    model = tiny_llama()
    expected = train_step(model)
    swapper = ActivationSwapper("cpu", min_swap_bytes=1024)
    for index, layer in enumerate(model.model.layers):
        tile_mlp(layer.mlp, tile_tokens=5)
        apply_policy(layer, policy, swapper, block_index=index)
    assert_same_step(expected, train_step(model))


def test_frozen_mlp_passes_only_input_grads() -> None:
    mlp = make_mlp().requires_grad_(False)
    _, expected = mlp_step(mlp)
    tile_mlp(mlp, tile_tokens=7)
    _, grads = mlp_step(mlp)
    torch.testing.assert_close(grads[0], expected[0], atol=1e-6, rtol=1e-5)
    assert all(g is None for g in grads[1:])


def test_the_norms_of_a_decoder_layer_are_found_and_tiled_with_its_mlp() -> None:
    """``find_norms`` returns a decoder layer's two RMSNorms, not the attention or the MLP;
    ``set_mlp_tiles`` tiles them with the MLP (exact per token) and untiles all with 0."""
    model = tiny_llama(n_layers=1)
    layer = model.model.layers[0]
    assert find_norms(layer) == [layer.input_layernorm, layer.post_attention_layernorm]
    x = torch.randn(2, 40, layer.input_layernorm.weight.shape[0], requires_grad=True)
    expected = layer.input_layernorm(x)
    (grad,) = torch.autograd.grad(expected.sum(), x)
    assert set_mlp_tiles([layer], 16) == 1
    assert all(is_tiled(m) for m in (layer.mlp, *find_norms(layer)))
    x2 = x.detach().requires_grad_()
    out = layer.input_layernorm(x2)
    (grad2,) = torch.autograd.grad(out.sum(), x2)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(grad2, grad, rtol=1e-6, atol=1e-6)
    set_mlp_tiles([layer], 0)
    assert not any(is_tiled(m) for m in (layer.mlp, *find_norms(layer)))
