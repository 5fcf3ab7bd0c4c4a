"""The user's optimizer and the CPU twins of offloaded params stay one optimizer however the
script builds and changes it (CPU simulation, attached vs plain): state it holds before it is
bound (it stepped before attach, a re-attach after ``disable()``, a state dict loaded before its
first step), a param group added after it stepped, and ``clip_grad_value_`` /
``clip_grads_with_norm_`` over offloaded gradients."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

import autooffload
from autooffload import runtime as rt
from tests.runtime.runtime_models import batches, enable_cpu, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = 6
Loop = Callable[[torch.nn.Module, torch.optim.Optimizer, int, bool], torch.nn.Module]


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _compare(make_optimizer: Callable, before_step: Loop) -> None:
    """Train plain and attached (``before_step`` may attach, detach or change the optimizer
    before step ``i``); losses, weights and optimizer state must agree."""
    base = tiny_llama(tied=False)
    runs = []
    for attached in (False, True):
        model = copy.deepcopy(base)
        optimizer = make_optimizer(model)
        losses = []
        for i, ids in enumerate(batches(STEPS)):
            model = before_step(model, optimizer, i, attached)
            losses.append(_step(model, optimizer, ids))
        state = copy.deepcopy(optimizer.state_dict()["state"])
        autooffload.disable()
        runs.append((losses, {k: v.clone() for k, v in model.state_dict().items()}, state))
    (plain_losses, plain_weights, plain_state), (losses, weights, state) = runs
    assert losses == pytest.approx(plain_losses, rel=1e-6, abs=1e-6)
    for name, weight in plain_weights.items():
        torch.testing.assert_close(weights[name], weight, rtol=1e-5, atol=1e-6, msg=name)
    assert state.keys() == plain_state.keys()
    for index, values in plain_state.items():
        for key, value in values.items():
            torch.testing.assert_close(state[index][key], value, rtol=1e-5, atol=1e-6)


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=1e-1, momentum=0.9)


def _attach(model: torch.nn.Module) -> torch.nn.Module:
    enable_cpu(n_persist=0)
    model.to("cpu")
    assert rt.runtime_of(model) is not None
    return model


@pytest.mark.parametrize("make_optimizer", [_adamw, _sgd], ids=["adamw", "sgd"])
def test_an_optimizer_that_stepped_before_attach_goes_on_from_its_state(make_optimizer):
    """The twins started from zero: Adam's step count back to 1, momentum forgotten."""

    def attach_at_step_2(model, optimizer, i, attached):
        return _attach(model) if attached and i == 2 else model

    _compare(make_optimizer, attach_at_step_2)


def test_a_reattach_after_disable_keeps_the_optimizers_state():
    def detach_then_attach(model, optimizer, i, attached):
        if attached and i == 0:
            return _attach(model)
        if attached and i == 2:
            autooffload.disable()  # the offloaded params' state goes to the optimizer
        if attached and i == 4:
            return _attach(model)
        return model

    _compare(_adamw, detach_then_attach)


def test_state_loaded_into_an_optimizer_built_before_attach():
    """``accelerator.load_state`` after ``prepare``: the optimizer is built before the
    attaching move and loaded before its first step (torch would have put the offloaded
    params' state on their device, and the twins ignored it)."""
    base = tiny_llama(tied=False)
    warm = copy.deepcopy(base)
    warm_optimizer = _adamw(warm)
    for ids in batches(2, seed=7):
        _step(warm, warm_optimizer, ids)
    saved_model, saved_state = warm.state_dict(), warm_optimizer.state_dict()

    def load_first(model, optimizer, i, attached):
        if i == 0:
            if attached:
                _attach(model)
            model.load_state_dict(saved_model)
            optimizer.load_state_dict(copy.deepcopy(saved_state))  # torch keeps its tensors
        return model

    _compare(_adamw, load_first)


def test_a_param_group_added_after_steps_is_updated_and_the_others_keep_their_state():
    """The added group's offloaded params had no twin: they were never updated."""

    def without_embedding(model):
        params = [p for n, p in model.named_parameters() if "embed" not in n]
        return torch.optim.AdamW(params, lr=1e-2)

    def add_embedding_at_step_2(model, optimizer, i, attached):
        if attached and i == 0:
            _attach(model)
        if i == 2:
            optimizer.add_param_group({"params": [model.model.embed_tokens.weight], "lr": 5e-2})
        return model

    _compare(without_embedding, add_embedding_at_step_2)


@pytest.mark.parametrize("clip", ["value", "with_norm"])
def test_clip_grad_value_and_clip_grads_with_norm_cover_offloaded_gradients(clip: str):
    """Unpatched, ``clip_grad_value_`` failed on an empty gradient list (every param
    offloaded) or left host gradients unclipped; ``clip_grads_with_norm_`` left them too."""
    base = tiny_llama(tied=False)
    runs = []
    for attached in (False, True):
        model = copy.deepcopy(base)
        if attached:
            _attach(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for ids in batches(4):
            model(input_ids=ids, labels=ids).loss.backward()
            if clip == "value":
                torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
            else:
                # The total norm from the patched clip_grad_norm_ (no clipping at inf max):
                # get_total_norm over .grad would not see the offloaded gradients.
                total = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
                torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.1, total)
            optimizer.step()
            optimizer.zero_grad()
        autooffload.disable()
        runs.append({k: v.clone() for k, v in model.state_dict().items()})
    for name, weight in runs[0].items():
        torch.testing.assert_close(runs[1][name], weight, rtol=1e-5, atol=1e-6, msg=name)
