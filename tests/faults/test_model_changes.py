"""Models changed after attach: a layer added on the compute device trains (as a resident
param), one added elsewhere is refused at the next forward; freezing stops a param's updates,
re-enabling a param trainable at attach resumes them, and a param frozen at attach that is
unfrozen is refused with the fix."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from _faults import assert_same_weights, batches, enable_cpu, tiny_llama, weights

import autooffload
from autooffload import runtime as rt
from autooffload.errors import AttachError

STEPS = 6


def train(
    model: torch.nn.Module,
    attach: dict | None,
    change: Callable[[torch.nn.Module, torch.optim.Optimizer, int], None],
) -> dict[str, torch.Tensor]:
    """Train ``STEPS`` steps, calling ``change(model, optimizer, step)`` after each step."""
    if attach is not None:
        enable_cpu(**attach)
        model.to("cpu")
        assert rt.runtime_of(model) is not None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    for step, ids in enumerate(batches(STEPS)):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        change(model, optimizer, step)
    if attach is not None:
        autooffload.disable()
    return weights(model)


def compare(change: Callable, attach: dict, **model_kw) -> tuple[dict, dict, dict]:
    base = tiny_llama(**model_kw)
    plain = train(copy.deepcopy(base), None, change)
    attached = train(copy.deepcopy(base), attach, change)
    assert_same_weights(plain, attached)
    return weights(base), plain, attached


SETTINGS = [{"n_persist": 0, "activation_mode": "keep"}, {"n_persist": 2}]
IDS = ["none-persistent", "two-persistent-auto"]


@pytest.mark.parametrize("attach", SETTINGS, ids=IDS)
def test_layer_added_after_attach_on_the_device_trains(attach):
    def add_adapter(model, optimizer, step):
        if step != 1:
            return
        torch.manual_seed(5)
        mlp = model.model.layers[1].mlp
        mlp.adapter = torch.nn.Linear(32, 32)  # created on the compute device (cpu here)
        mlp.register_forward_hook(lambda m, a, out: out + m.adapter(out))
        optimizer.add_param_group({"params": list(mlp.adapter.parameters())})

    _, plain, attached = compare(add_adapter, attach)
    assert "model.layers.1.mlp.adapter.weight" in attached


def test_param_added_off_the_compute_device_is_refused_at_the_next_forward():
    model = tiny_llama()
    enable_cpu(n_persist=0)
    model.to("cpu")
    model.model.layers[1].mlp.extra = torch.nn.Linear(32, 32, device="meta")
    ids = batches(1)[0]
    with pytest.raises(AttachError) as error:
        model(input_ids=ids, labels=ids)
    message = str(error.value)
    assert "model.layers.1.mlp.extra.weight" in message and "AUTOOFFLOAD_OFFLOAD=0" in message


def _freeze(prefix: str, requires_grad: bool = False) -> Callable[[torch.nn.Module], None]:
    def apply(model: torch.nn.Module) -> None:
        for name, param in model.named_parameters():
            if name.startswith(prefix):
                param.requires_grad_(requires_grad)

    return apply


@pytest.mark.parametrize("attach", SETTINGS, ids=IDS)
def test_freezing_a_layer_mid_training_stops_its_updates(attach):
    frozen_at = {}

    def freeze_layer_2(model, optimizer, step):
        if step == 1:
            _freeze("model.layers.2.")(model)
            frozen_at[len(frozen_at)] = weights(model)

    _, plain, attached = compare(freeze_layer_2, attach, tied=False)
    names = [n for n in plain if n.startswith("model.layers.2.")]
    assert names
    for name in names:
        # Weight decay would move it if the optimizer still stepped it.
        assert torch.equal(attached[name], frozen_at[1][name]), name


@pytest.mark.parametrize("attach", SETTINGS, ids=IDS)
def test_freeze_then_unfreeze_a_param_trainable_at_attach_resumes_training(attach):
    """Frozen before the first step (the CPU optimizer twin is built without it), unfrozen
    later: it must train again, with its own optimizer state, like plain PyTorch."""
    base = tiny_llama(tied=False)
    _freeze("model.layers.2.")(base)
    base_trainable = copy.deepcopy(base)
    _freeze("model.layers.2.", True)(base_trainable)

    def unfreeze(model, optimizer, step):
        if step == 2:
            _freeze("model.layers.2.", True)(model)

    runs = []
    for attach_settings in (None, attach):
        model = copy.deepcopy(base_trainable)
        if attach_settings is not None:
            enable_cpu(**attach_settings)
            model.to("cpu")
        _freeze("model.layers.2.")(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
        for step, ids in enumerate(batches(STEPS)):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            unfreeze(model, optimizer, step)
        autooffload.disable()
        runs.append(weights(model))
    assert_same_weights(*runs)
    moved = (
        runs[0]["model.layers.2.mlp.up_proj.weight"]
        - weights(base)["model.layers.2.mlp.up_proj.weight"]
    )
    assert moved.abs().max() > 1e-3, "layer 2 never trained after unfreezing"


def test_unfreezing_a_param_frozen_at_attach_is_refused_at_the_next_forward():
    model = tiny_llama(tied=False)
    _freeze("model.layers.2.")(model)
    enable_cpu(n_persist=0)
    model.to("cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    _freeze("model.layers.2.", True)(model)
    with torch.no_grad():
        model(input_ids=ids)  # evaluation needs no gradient buffer: still allowed
    with pytest.raises(AttachError) as error:
        model(input_ids=ids, labels=ids)
    message = str(error.value)
    assert "model.layers.2." in message and "AUTOOFFLOAD_OFFLOAD=0" in message
    assert "frozen when the model was attached" in message
