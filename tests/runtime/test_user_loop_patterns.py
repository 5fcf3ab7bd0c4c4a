"""Training-loop patterns from user scripts, attached vs plain (CPU simulation): dropout with the
default plan (the profiler's probes must not move the user's RNG), two backwards through one
retained graph over checkpointed blocks, and an ``inference_mode`` eval in the profiling steps."""

from __future__ import annotations

import copy
import io
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import autooffload
from autooffload import runtime as rt
from tests.runtime.runtime_models import batches, enable_cpu, tiny_llama, train_two_optimizers

pytestmark = pytest.mark.usefixtures("one_thread")


def _plain_then_attached(
    base: torch.nn.Module,
    train: Callable[[torch.nn.Module, bool], Any],
    before_train: Callable[[torch.nn.Module], None] | None = None,
    **settings: Any,
) -> list[Any]:
    """``train(model, attached)`` on a copy of ``base``, plain, then attached (every chunk
    offloaded, ``settings``); ``before_train`` runs on each model after the move."""
    results = []
    for attached in (False, True):
        model = copy.deepcopy(base)
        if attached:
            enable_cpu(**{"n_persist": 0, **settings})
            model.to("cpu")
        if before_train is not None:
            before_train(model)
        results.append(train(model, attached))
        autooffload.disable()
    return results


def _dropout_llama() -> torch.nn.Module:
    model = tiny_llama(tied=False)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.2
    return model


def test_dropout_trains_like_plain_and_the_rng_stays_where_plain_leaves_it():
    """The profiling step re-runs one block per class in train mode (its probe); with dropout
    that drew from the global RNG, so every later step (and the data order of a DataLoader
    seeded from it) differed from plain training."""

    def train(model: torch.nn.Module, attached: bool) -> list[float]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(123)
        seen = []
        for ids in batches(5):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            seen += [loss.item(), torch.rand(1).item()]
        return seen

    runs = _plain_then_attached(_dropout_llama(), train)
    assert runs[1] == pytest.approx(runs[0], rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("mode", [None, "checkpoint", "checkpoint_cpu", "swap", "keep"])
def test_two_backwards_through_one_retained_graph(mode: str | None):
    """``l1.backward(retain_graph=True); l2.backward()``: a checkpointed block is recomputed in
    each backward, entering its recompute context twice (it failed the second time)."""

    def train(model: torch.nn.Module, attached: bool) -> tuple[list[float], dict]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for ids in batches(4):
            out = model(input_ids=ids, labels=ids)
            extra = out.logits.float().pow(2).mean() * 0.01
            out.loss.backward(retain_graph=True)
            extra.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append((out.loss + extra).item())
        return losses, model

    settings = {"activation_mode": mode} if mode else {}
    runs = _plain_then_attached(tiny_llama(tied=False), train, **settings)
    runs = [(losses, {k: v.clone() for k, v in m.state_dict().items()}) for losses, m in runs]
    (plain_losses, plain_weights), (losses, weights) = runs
    assert losses == pytest.approx(plain_losses, rel=1e-5, abs=1e-6)
    for name, weight in plain_weights.items():
        torch.testing.assert_close(weights[name], weight, rtol=1e-5, atol=1e-5, msg=name)


def test_an_inference_mode_eval_in_the_profiling_steps_is_not_profiled():
    """The profiler kept the last forward's block inputs, an inference tensor from the eval,
    and its probe then failed at ``optimizer.step()`` (requires_grad on an inference tensor)."""
    enable_cpu(n_persist=0)
    model = tiny_llama(tied=False).to("cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for ids in batches(4):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.inference_mode():
            model(input_ids=ids[:1, :5])
    runtime = autooffload.runtime.runtime_of(model)
    assert "search" in runtime.plan.source
    assert runtime.profile.batch_tokens == ids.numel()  # the training batch's, not the eval's


def test_deepcopy_or_pickling_an_attached_model_raises_a_clear_error_and_works_after_detach():
    """A deepcopy read released storage (a segfault) or failed pickling the runtime's lock;
    ``torch.save(model)`` failed on a hook's lambda."""
    enable_cpu(n_persist=0)
    model = tiny_llama(tied=False).to("cpu")
    for target in (model, model.model.layers[1]):
        with pytest.raises(autooffload.AttachError, match="deepcopy.*load_state_dict"):
            copy.deepcopy(target)
    with pytest.raises(autooffload.AttachError, match="state_dict"):
        torch.save(model, io.BytesIO())
    autooffload.disable()
    torch.save(model, io.BytesIO())
    twin = copy.deepcopy(model)
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("reentrant", [True, False])
def test_hf_gradient_checkpointing_turned_on_after_attach_is_taken_over(reentrant: bool):
    """HF ``Trainer`` turns it on in ``train()``, after its move attached the model. Left on,
    HF's reentrant checkpoint wrapped the block policies and the profiling probe failed
    (``torch.autograd.grad`` through a reentrant checkpoint)."""

    def enable_gc(model: torch.nn.Module) -> None:
        kwargs = {"use_reentrant": reentrant}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    def train(model: torch.nn.Module, attached: bool) -> tuple[list[float], torch.nn.Module]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for ids in batches(4):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        if attached:
            assert not any(layer.gradient_checkpointing for layer in model.model.layers)
        return losses, model

    (plain, _), (losses, model) = _plain_then_attached(
        tiny_llama(tied=False), train, before_train=enable_gc
    )
    assert losses == pytest.approx(plain, rel=1e-6, abs=1e-6)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)  # restored


@pytest.mark.parametrize("clear", ["zero_grad", "by_hand"])
def test_a_backward_after_a_step_without_zero_grad_is_warned_once(clear: str):
    """Offloaded params keep their gradients on the host, not in ``.grad``: a loop clearing
    ``p.grad = None`` by hand left them accumulating across steps, silently."""
    from autooffload.log import reset_warnings

    reset_warnings()
    enable_cpu(n_persist=0)
    model = tiny_llama(tied=False).to("cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for ids in batches(3):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            if clear == "zero_grad":
                optimizer.zero_grad()
            else:
                for param in model.parameters():
                    param.grad = None
    hits = [w for w in caught if "no zero_grad() since" in str(w.message)]
    assert len(hits) == (1 if clear == "by_hand" else 0), [str(w.message) for w in caught]


def test_gradients_left_for_a_later_step_survive_the_switch_to_the_searched_plan():
    """Two optimizers, the second stepping every other backward: at the switch after the
    profiling steps its params' gradients of one backward wait for its next step. The chunks
    the searched plan keeps on the device take them along as their ``.grad``."""

    def train(model: torch.nn.Module, attached: bool) -> tuple[list[float], dict, int]:
        losses = train_two_optimizers(model, 5, every_other=0)
        persistent = len(rt.runtime_of(model).manager.persistent) if attached else 0
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return losses, weights, persistent

    (plain_losses, plain, _), (losses, weights, persistent) = _plain_then_attached(
        tiny_llama(tied=False), train, n_persist=None, update_in_backward=False
    )
    assert persistent > 1, "the searched plan promoted no layer chunk: nothing to test"
    assert losses == pytest.approx(plain_losses, rel=1e-6)
    for name, value in plain.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("every_other", [None, 0], ids=["both-every-step", "b-every-other"])
def test_one_optimizers_zero_grad_keeps_the_others_gradients_still_queued(
    monkeypatch, every_other: int | None
):
    """Two optimizers over disjoint params, ``a.step(); a.zero_grad(); b.step()``: ``a``'s
    zero_grad must clear ``a``'s host gradients only, also while the worker is still adding up
    ``b``'s (it read the masters' gradients, not yet set, found ``a``'s params were all of
    them and cleared every one: ``b`` stepped on nothing, under load now and then). Only the
    worker's gradient sums are slowed here, so that ``a.zero_grad()`` always comes before them
    (``slow_workers`` delays every task alike, the clears too)."""
    import time

    from autooffload.runtime.update.grad_staging import GradStaging

    accumulate = GradStaging._accumulate

    def slow(self, *args, **kwargs):
        time.sleep(0.01)
        return accumulate(self, *args, **kwargs)

    monkeypatch.setattr(GradStaging, "_accumulate", slow)

    def train(model: torch.nn.Module, attached: bool) -> tuple[list[float], dict]:
        losses = train_two_optimizers(model, 6, every_other)
        if attached:
            rt.runtime_of(model).synchronize()
        return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}

    (plain_losses, plain), (losses, weights) = _plain_then_attached(
        tiny_llama(n_layers=2, tied=False), train, n_persist=None
    )
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    for name, value in plain.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_zeroed_gradients_cleared_twice_before_a_backward_keep_its_gradients(slow_workers):
    """``zero_grad(set_to_none=False)`` zeroes the host gradients where they are: after the
    first backward since the last clear that is the gradient staging itself. A second such
    clear before the next backward (``model.zero_grad`` beside ``optimizer.zero_grad``; a step
    of an iteration that skipped its backward, in test_gpu_update.py) zeroes the staging again
    on the worker; the next backward's copy into the staging must wait for it, or the clear
    zeroes the new gradients (the worker is slowed here so that it runs late)."""
    slow_workers.prefixes = ("autooffload-cpu-optim",)
    slow_workers.delay_s = (0.02, 0.03)
    base = tiny_llama(n_layers=2, tied=False)

    def train(model: torch.nn.Module, attached: bool) -> list[float]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        losses = []
        for ids in batches(6):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            model.zero_grad(set_to_none=False)
        if attached:
            rt.runtime_of(model).synchronize()
        return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}

    (plain_losses, plain), (losses, weights) = _plain_then_attached(base, train)
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    for name, value in plain.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=name)
