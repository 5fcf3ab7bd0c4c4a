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


def _checkpoint_through_hooks(model: nn.Module, attached: bool) -> list:
    """Train, save the optimizer with a post hook that tags the dict, load it into a fresh
    optimizer whose pre hook zeroes every first moment and whose post hook reads its state,
    train on: what the hooks saw, then the weights."""
    if attached:
        _attach(model)
    seen: list = []

    def tag(opt: torch.optim.Optimizer, state_dict: dict) -> dict:
        seen.append(sorted(state_dict["state"]))
        return {**state_dict, "tag": "saved"}

    def zero_first_moments(opt: torch.optim.Optimizer, state_dict: dict) -> dict:
        seen.append(sorted(state_dict["state"]))
        state = {
            k: {**v, "exp_avg": torch.zeros_like(v["exp_avg"])}
            for k, v in state_dict["state"].items()
        }
        return {**state_dict, "state": state}

    def after_load(opt: torch.optim.Optimizer) -> None:
        state = opt.state_dict()["state"]
        seen.append(sorted(state))
        seen.append(sum(float(s["exp_avg"].abs().sum()) for s in state.values()))

    optimizer = _adamw(model)
    data = batches(3)
    for ids in data[:2]:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.register_state_dict_post_hook(tag)
    saved = optimizer.state_dict()
    seen.append(saved.pop("tag"))
    resumed = _adamw(model)
    resumed.register_load_state_dict_pre_hook(zero_first_moments)
    resumed.register_load_state_dict_post_hook(after_load)
    resumed.load_state_dict(saved)
    model(input_ids=data[2], labels=data[2]).loss.backward()
    resumed.step()
    seen.append(model.state_dict()[WATCHED].clone())
    autooffload.disable()
    return seen


def test_optimizer_state_dict_hooks_see_and_change_every_params_state() -> None:
    plain = tiny_llama(n_layers=2)
    attached = copy.deepcopy(plain)
    expected = _checkpoint_through_hooks(plain, attached=False)
    actual = _checkpoint_through_hooks(attached, attached=True)
    n_params = len(list(plain.parameters()))
    assert expected[0] == list(range(n_params))
    assert actual[:-2] == expected[:-2]
    assert actual[-2] == 0.0
    torch.testing.assert_close(actual[-1], expected[-1], rtol=0, atol=0)
