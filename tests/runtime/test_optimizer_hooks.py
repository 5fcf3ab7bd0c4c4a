"""The user's optimizer hooks on an optimizer bound to an attached model: called as torch calls
them, seeing what they see on a plain model (stepped weights, every param's state)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import autooffload
from tests.runtime.runtime_models import batches, enable_cpu, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

WATCHED = "model.layers.1.mlp.up_proj.weight"


def _attach(model: nn.Module) -> None:
    enable_cpu(n_persist=0)
    model.to("cpu")


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)


def _train(
    model: nn.Module, attached: bool, hook: Callable[[nn.Module, torch.optim.Optimizer], list]
) -> list:
    if attached:
        _attach(model)
    optimizer = _adamw(model)
    seen = hook(model, optimizer)
    for ids in batches(3):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    seen.append(model.state_dict()[WATCHED].clone())
    autooffload.disable()
    return seen


def _weights_and_schedule_in_post_hook(model: nn.Module, optimizer: torch.optim.Optimizer) -> list:
    """A post hook that reads the weights (an EMA) and one that steps the LR schedule."""
    seen: list[torch.Tensor] = []
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    optimizer.register_step_post_hook(
        lambda opt, args, kwargs: seen.append(model.state_dict()[WATCHED].clone())
    )
    optimizer.register_step_post_hook(lambda opt, args, kwargs: scheduler.step())
    return seen


def test_step_post_hooks_see_the_stepped_weights_and_may_step_the_schedule() -> None:
    plain = tiny_llama(n_layers=2)
    attached = copy.deepcopy(plain)
    expected = _train(plain, False, _weights_and_schedule_in_post_hook)
    actual = _train(attached, True, _weights_and_schedule_in_post_hook)
    assert len(actual) == len(expected) == 4
    for step, (value, reference) in enumerate(zip(actual, expected, strict=True)):
        torch.testing.assert_close(value, reference, rtol=0, atol=0, msg=f"after step {step}")
