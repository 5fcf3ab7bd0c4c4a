"""AMP loss scaling (``torch.amp.GradScaler``) over offloaded params: host gradients are
unscaled with the device ones, non-finite values in them are found, and a skipped step updates
no offloaded param, so the attached run follows plain PyTorch step for step."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
from _faults import assert_same_weights, batches, enable_cpu, tiny_llama, weights

import autooffload
from autooffload import runtime as rt

STEPS = 6


def fused_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    """Fused: GradScaler hands it grad_scale and found_inf and calls its step every time."""
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)


def foreach_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    """Not fused: GradScaler unscales the gradients itself and skips ``step`` on inf/nan."""
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)


def sgd_momentum(model: torch.nn.Module) -> torch.optim.Optimizer:
    # Not fused: torch's fused CPU SGD fills the momentum buffer from the inf gradients of a
    # skipped first step (plain training diverges), while the CPU twin skips the step whole.
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)


OPTIMIZERS = {"fused-adamw": fused_adamw, "foreach-adamw": foreach_adamw, "sgd": sgd_momentum}


def train_scaled(
    model: torch.nn.Module,
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    attach: dict | None,
    *,
    init_scale: float,
    backoff: float = 0.5,
    poison: Callable[[torch.nn.Module], torch.Tensor] | None = None,
    poison_step: int = 2,
    clip: float | None = None,
) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Train with loss scaling; ``poison(model)`` names a param whose gradient turns inf at
    ``poison_step``. Returns the losses, the scale after every step and the final weights."""
    if attach is not None:
        enable_cpu(**attach)
        model.to("cpu")
        assert rt.runtime_of(model) is not None
    optimizer = make_optimizer(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, backoff_factor=backoff)
    armed = {"on": False}
    if poison is not None:
        poison(model).register_hook(lambda g: g * math.inf if armed["on"] else g)
    losses, scales = [], []
    for step, ids in enumerate(batches(STEPS)):
        armed["on"] = step == poison_step
        loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    if attach is not None:
        autooffload.disable()
    return losses, scales, weights(model)


def assert_same_scaled_training(plain: tuple, attached: tuple) -> None:
    assert attached[1] == plain[1], "the scaler skipped different steps"
    torch.testing.assert_close(torch.tensor(attached[0]), torch.tensor(plain[0]))
    assert_same_weights(plain[2], attached[2])


@pytest.mark.parametrize("clip", [None, 1.0], ids=["step", "unscale-clip-step"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS.values()), ids=list(OPTIMIZERS))
@pytest.mark.parametrize("n_persist", [0, 2])
def test_overflowing_first_step_is_skipped_then_trains(optimizer, n_persist, clip):
    base = tiny_llama()
    settings = {"n_persist": n_persist, "activation_mode": "keep"}
    # A backoff of 2**-120 brings the overflowing scale 2**127 down to 2**7 in one skip.
    kwargs = {"init_scale": 2.0**127, "backoff": 2.0**-120, "clip": clip}
    plain = train_scaled(copy.deepcopy(base), optimizer, None, **kwargs)
    attached = train_scaled(copy.deepcopy(base), optimizer, settings, **kwargs)
    assert plain[1][0] < 2.0**10, "the first step did not overflow; the test proves nothing"
    assert_same_scaled_training(plain, attached)
    assert all(torch.isfinite(w).all() for w in attached[2].values())


def _late_offloaded_weight(model: torch.nn.Module) -> torch.Tensor:
    return model.model.layers[2].mlp.down_proj.weight


@pytest.mark.parametrize("clip", [None, 1.0], ids=["step", "unscale-clip-step"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS.values()), ids=list(OPTIMIZERS))
def test_inf_only_in_an_offloaded_gradient_skips_the_whole_step(optimizer, clip):
    """Device gradients are all finite: only the host side can see the inf."""
    base = tiny_llama()
    settings = {"n_persist": 1, "activation_mode": "keep"}
    kwargs = {"init_scale": 2.0**8, "poison": _late_offloaded_weight, "clip": clip}
    plain = train_scaled(copy.deepcopy(base), optimizer, None, **kwargs)
    model = copy.deepcopy(base)
    attached = train_scaled(model, optimizer, settings, **kwargs)
    assert plain[1][2] < plain[1][1], "the poisoned step was not skipped in the reference"
    assert_same_scaled_training(plain, attached)
    assert all(torch.isfinite(w).all() for w in attached[2].values())


def test_skipped_step_leaves_offloaded_params_bit_identical():
    model = tiny_llama()
    enable_cpu(n_persist=1, activation_mode="keep")
    model.to("cpu")
    runtime = rt.runtime_of(model)
    optimizer = fused_adamw(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)
    before = weights(model)
    ids = batches(1)[0]
    scaler.scale(model(input_ids=ids, labels=ids).loss).backward()
    scaler.step(optimizer)
    scaler.update()
    runtime.synchronize()
    assert scaler.get_scale() < 2.0**127
    for name, weight in weights(model).items():
        assert torch.equal(weight, before[name]), name
