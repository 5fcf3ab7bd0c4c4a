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
