"""Autograd patterns of user code, attached vs plain (CPU simulation, every chunk offloaded):
gradients asked for by ``torch.autograd.grad``, user hooks, blocks whose params do not all take
a gradient, and the double backward that offloaded weights cannot take part in."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

import autooffload
from tests.runtime.runtime_models import batches, enable_cpu, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


def _plain_then_attached(
    base: torch.nn.Module, train: Callable[[torch.nn.Module], Any], **settings: Any
) -> list[tuple[Any, dict[str, torch.Tensor]]]:
    """``train(model)`` on a copy of ``base``, plain, then attached (every chunk offloaded);
    each run's result and its weights after detaching."""
    runs = []
    for attached in (False, True):
        model = copy.deepcopy(base)
        if attached:
            enable_cpu(n_persist=0, **settings)
            model.to("cpu")
        result = train(model)
        autooffload.disable()
        runs.append((result, {k: v.detach().clone() for k, v in model.state_dict().items()}))
    return runs


def _assert_same(runs: list[tuple[Any, dict[str, torch.Tensor]]], tol: float = 1e-6) -> None:
    (plain, plain_weights), (got, weights) = runs
    torch.testing.assert_close(got, plain, rtol=tol, atol=tol)
    for name, weight in plain_weights.items():
        torch.testing.assert_close(weights[name], weight, rtol=tol, atol=tol, msg=name)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("grad_call", ["autograd.grad", "backward"])
def test_a_create_graph_backward_raises_before_the_weights_are_read_released(grad_call: str):
    """A gradient penalty differentiates the backward's own graph, which saved offloaded
    weights released when that backward ended (a segfault, or garbage on a GPU)."""
    enable_cpu(n_persist=0)
    model = tiny_llama(tied=False).to("cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = batches(1)[0]
    loss = model(input_ids=ids, labels=ids).loss
    with pytest.raises(autooffload.UnsupportedAutogradError, match="create_graph=True"):
        if grad_call == "autograd.grad":
            torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
        else:
            loss.backward(create_graph=True)
    optimizer.zero_grad()
    for ids in batches(2):  # training goes on
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


class _Block(torch.nn.Module):
    """A residual MLP block; ``frozen_path`` runs its norm and first layer under ``no_grad``."""

    def __init__(self, width: int, frozen_path: bool) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)
        self.frozen_path = frozen_path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad() if self.frozen_path else torch.enable_grad():
            h = self.up(self.norm(x))
        return x + self.down(torch.nn.functional.gelu(h))


class _Stack(torch.nn.Module):
    """Not a transformers model: an input layer, a list of blocks, a head."""

    def __init__(self, block: Callable[[int], torch.nn.Module], width: int = 48) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, width)
        self.layers = torch.nn.ModuleList(block(width) for _ in range(3))
        self.head = torch.nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _train_stack(model: torch.nn.Module) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(3):
        loss = model(torch.randn(4, 6, 8, generator=generator)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_block_with_params_outside_the_graph_trains_like_plain():
    """Part of each block runs under ``no_grad``: its params get no gradient, and the profiling
    step's block probe refused the block (a param not in the graph)."""
    runs = _plain_then_attached(
        _Stack(lambda width: _Block(width, frozen_path=True)), _train_stack, chunk_size=8000
    )
    _assert_same(runs, tol=0)


@pytest.mark.parametrize("clip", [False, True])
def test_gradients_from_autograd_grad_assigned_to_grad_train_like_plain(clip: bool):
    """``grads = torch.autograd.grad(loss, params)`` then ``p.grad = g``: the user's optimizer
    stepped the offloaded params' released storage, and clipping missed their gradients."""

    def train(model: torch.nn.Module) -> list[float]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        seen = []
        for ids in batches(3):
            loss = model(input_ids=ids, labels=ids).loss
            params = list(model.parameters())
            for param, grad in zip(params, torch.autograd.grad(loss, params), strict=True):
                param.grad = grad
            if clip:
                seen.append(torch.nn.utils.clip_grad_norm_(params, 0.5).item())
            optimizer.step()
            optimizer.zero_grad()
            seen.append(loss.item())
        return seen

    _assert_same(_plain_then_attached(tiny_llama(tied=False), train), tol=0)


def test_user_gradient_hooks_see_the_step_gradients_only():
    """A param's gradient hook and a block's backward hook are called once per backward with
    plain torch's gradients; the profiling step's block probe called them again, with its own."""

    def train(model: torch.nn.Module) -> dict[str, list[torch.Tensor]]:
        seen: dict[str, list[torch.Tensor]] = {"block": [], "param": [], "accumulated": []}
        block = model.model.layers[0]
        block.register_full_backward_hook(lambda m, gi, go: seen["block"].append(go[0].clone()))
        weight = block.mlp.up_proj.weight
        weight.register_hook(lambda grad: seen["param"].append(grad.clone()))
        weight.register_post_accumulate_grad_hook(
            lambda p: seen["accumulated"].append(p.grad.clone())
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        for ids in batches(3):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return seen

    runs = _plain_then_attached(tiny_llama(tied=False), train)
    seen = runs[1][0]
    assert {k: len(v) for k, v in seen.items()} == {"block": 3, "param": 3, "accumulated": 3}
    _assert_same(runs, tol=0)


class _ReentrantStack(_Stack):
    """The user's model checkpoints each block with ``use_reentrant=True``: the block's forward
    runs under ``no_grad`` and again inside the backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=True)
        return self.head(h)


def test_reentrant_checkpointing_around_blocks_is_a_clear_error_at_the_profiling_step():
    """The profiling step saw no training forward of the blocks (a bare KeyError in the
    profile's build); the error names ``use_reentrant=False``."""
    enable_cpu(n_persist=0, chunk_size=8000)
    model = _ReentrantStack(lambda width: _Block(width, frozen_path=False)).to("cpu")
    with pytest.raises(autooffload.PlanError, match="use_reentrant=False"):
        _train_stack(model)


class _ReentrantBlock(_Block):
    """A block whose own forward checkpoints its MLP with ``use_reentrant=True``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def mlp(h: torch.Tensor) -> torch.Tensor:
            return self.down(torch.nn.functional.gelu(self.up(self.norm(h))))

        return x + torch.utils.checkpoint.checkpoint(mlp, x, use_reentrant=True)


def test_reentrant_checkpointing_inside_a_block_is_a_clear_error_at_the_profiling_step():
    """The block probe times a block's backward alone (``torch.autograd.grad``), which a
    reentrant checkpoint refuses; the error names ``use_reentrant=False``."""
    enable_cpu(n_persist=0, chunk_size=8000)
    model = _Stack(lambda width: _ReentrantBlock(width, frozen_path=False)).to("cpu")
    with pytest.raises(autooffload.PlanError, match="use_reentrant=False"):
        _train_stack(model)
