"""AUTOOFFLOAD_UPDATE_IN_BACKWARD=auto (the default): the update in the backward is turned on for
loops that neither clip, accumulate, scale, read the gradients nor change hyperparameters between
backward and step, and left off for every other loop, which then trains exactly like plain
PyTorch. Once on, a larger batch runs without it (its OOM stays retryable), a later reason seen
in such a step turns it off, and one seen after early updates is a clear error."""

from __future__ import annotations

import logging

import pytest
import torch
from runtime_models import BATCH, SEQ, VOCAB, train_two_optimizers

import autooffload
from autooffload import runtime as rt
from autooffload.errors import UpdateInBackwardError
from autooffload.runtime.update.update_mode import CHOOSE_GAIN

pytestmark = pytest.mark.usefixtures("one_thread")

LR = 1e-2


def _pair(make_llama, offload_cpu, **settings):
    """A plain model and an attached copy (a fixed plan: the first step decides)."""
    torch.manual_seed(0)
    plain = make_llama(n_layers=2)
    model = make_llama(n_layers=2)
    model.load_state_dict(plain.state_dict())
    offload_cpu(**{"n_persist": 1, "activation_mode": "keep", **settings})
    model.to("cpu")
    return plain, model, rt.runtime_of(model)


def _step(net, optimizer, ids, loop: str, step: int, scaler=None, seen=None) -> None:
    """One step of ``loop``; ``seen()`` runs after the backward passes."""
    micro = 2 if loop == "accumulate" else 1
    for _ in range(micro):
        loss = net(input_ids=ids, labels=ids).loss / micro
        (scaler.scale(loss) if scaler is not None else loss).backward()
    if seen is not None:
        seen()
    if loop == "clip":
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
    if loop == "lr_change":  # set between backward and step, as some scripts do
        for group in optimizer.param_groups:
            group["lr"] = LR * 0.9 ** (step + 1)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad()


def _assert_same_weights(model, plain) -> None:
    reference = plain.state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("loop", ["plain", "clip", "accumulate", "lr_change", "scaler"])
def test_auto_turns_it_on_only_for_loops_it_is_exact_for(
    make_llama, offload_cpu, make_batches, loop
):
    plain, model, runtime = _pair(make_llama, offload_cpu)
    offloaded = sorted(
        c.index for c in runtime.layout.chunks if c.index not in runtime.manager.persistent
    )
    early = []
    for net in (plain, model):
        optimizer = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
        scaler = torch.amp.GradScaler("cpu") if loop == "scaler" else None
        seen = None
        if net is model:
            seen = lambda: early.append(sorted(runtime.cpu_optim.early.offloaded))
        for step, ids in enumerate(make_batches(5)):
            _step(net, optimizer, ids, loop, step, scaler, seen)
    runtime.synchronize()
    _assert_same_weights(model, plain)
    if loop == "plain":
        assert runtime.backward_update.on
        assert early[0] == [] and all(e == offloaded for e in early[1:]), early
    else:
        assert not runtime.backward_update.on
        assert all(e == [] for e in early), early


def test_the_first_search_takes_it_only_when_predicted_faster():
    from runtime_models import batches, enable_cpu, tiny_llama

    enable_cpu(n_persist=0)  # the default plan: two profiling steps, then the search
    model = tiny_llama(tied=False).to("cpu")
    runtime = rt.runtime_of(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    armed = []
    for ids in batches(4):
        model(input_ids=ids, labels=ids).loss.backward()
        armed.append(bool(runtime.cpu_optim.early.offloaded))
        optimizer.step()
        optimizer.zero_grad()
    assert "search" in runtime.plan.source
    with_s, without_s = runtime.backward_update.predicted
    on = with_s <= (1 - CHOOSE_GAIN) * without_s
    assert runtime.backward_update.on is on
    assert runtime.profile.update_in_backward is on
    assert runtime.plan.predicted_step_s == pytest.approx(with_s if on else without_s)
    assert armed == [False, False, on, on]  # the profiling steps update at step()
    summary = runtime.plan.summary()
    assert ("optimizer: in the backward, offloaded chunks updated" in summary) is on


@pytest.mark.parametrize("faster", [True, False])
def test_choose_keeps_the_faster_plan(make_llama, offload_cpu, make_batches, faster):
    """The choice itself, on one profiled model with the predictions scripted."""
    from dataclasses import replace

    _, model, runtime = _pair(make_llama, offload_cpu, n_persist=None, activation_mode="auto")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for ids in make_batches(3):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    mode = runtime.backward_update
    mode.decided, mode.predicted = True, None
    runtime.cpu_optim.in_backward.arm(offloaded=True)
    request, profile = runtime.search_request, replace(runtime.profile, update_in_backward=True)
    without_s = request.plan().predicted_step_s
    with_s = without_s * (0.9 if faster else 0.97)
    plan = replace(runtime.plan, predicted_step_s=with_s)
    _, chosen_profile, chosen = mode.choose(request, profile, plan)
    assert mode.on is faster and runtime.cpu_optim.in_backward.armed is faster
    assert chosen_profile.update_in_backward is faster
    assert chosen.predicted_step_s == pytest.approx(with_s if faster else without_s)


def test_a_batch_larger_than_any_trained_runs_without_it(make_llama, offload_cpu, make_batches):
    plain, model, runtime = _pair(make_llama, offload_cpu)
    generator = torch.Generator().manual_seed(5)
    longer = torch.randint(0, VOCAB, (BATCH, SEQ * 2), generator=generator)
    data = make_batches(2) + [longer] + make_batches(2, seed=3)
    early, persistent = [], []
    for net in (plain, model):
        optimizer = torch.optim.AdamW(net.parameters(), lr=LR)
        for ids in data:
            net(input_ids=ids, labels=ids).loss.backward()
            if net is model:
                early.append(bool(runtime.cpu_optim.early.offloaded))
                persistent.append(sorted(runtime.cpu_optim.early.persistent))
                stepped = [s.param for s in runtime.layout.chunks[0].trainable_slots]
                assert (persistent[-1] == [0]) is all(p.grad is None for p in stepped)
            optimizer.step()
            optimizer.zero_grad()
    runtime.synchronize()
    _assert_same_weights(model, plain)
    # Step 3's batch was the longest yet; the shorter ones after it are covered by it. The
    # persistent chunk is stepped in every backward once on, the longer batch's too: the plan
    # counts on its gradients being dropped there.
    assert early == [False, True, False, True, True]
    assert persistent == [[], [0], [0], [0], [0]]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_reason_seen_in_a_step_without_early_updates_turns_it_off(
    make_llama, offload_cpu, make_batches
):
    # No persistent chunk: one would be stepped in the longer batch's backward (an early update).
    plain, model, runtime = _pair(make_llama, offload_cpu, log="info", n_persist=0)
    generator = torch.Generator().manual_seed(5)
    longer = torch.randint(0, VOCAB, (BATCH, SEQ * 2), generator=generator)
    data = make_batches(2) + [longer] + make_batches(2, seed=3)
    lines = _Lines()
    logging.getLogger("autooffload").addHandler(lines)
    try:
        for net in (plain, model):
            optimizer = torch.optim.AdamW(net.parameters(), lr=LR)
            for step, ids in enumerate(data):
                net(input_ids=ids, labels=ids).loss.backward()
                if step == 2:  # the longer batch's step clips: nothing was updated early
                    torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
                if net is model and step > 2:
                    assert not runtime.cpu_optim.early.offloaded
                optimizer.step()
                optimizer.zero_grad()
    finally:
        logging.getLogger("autooffload").removeHandler(lines)
    runtime.synchronize()
    _assert_same_weights(model, plain)
    assert not runtime.backward_update.on
    assert any("from now on" in line and "clip_grad_norm_" in line for line in lines.lines)


def test_a_reason_seen_after_early_updates_is_a_clear_error(make_llama, offload_cpu, make_batches):
    _, model, runtime = _pair(make_llama, offload_cpu)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    ids = make_batches(1)[0]
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    assert runtime.cpu_optim.early.offloaded
    optimizer.param_groups[0]["lr"] = LR / 2  # a schedule that starts late, set before step()
    with pytest.raises(UpdateInBackwardError, match="AUTOOFFLOAD_UPDATE_IN_BACKWARD=auto.*=0"):
        optimizer.step()


@pytest.mark.parametrize("read", ["no_grad", "generate", "gathered"])
def test_a_loop_reading_the_weights_between_backward_and_step_keeps_it_off(
    make_llama, offload_cpu, make_batches, read
):
    """An evaluation, a ``generate`` or a weight read between a backward and its step sees the
    weights before the step in plain PyTorch; an update in the backward had already changed
    them, so such a loop keeps the update at ``step()``, and every read equals plain's."""
    plain, model, runtime = _pair(make_llama, offload_cpu)
    prompt = make_batches(1, seed=9)[0][:1]
    seen: dict[bool, list[torch.Tensor]] = {False: [], True: []}
    for net in (plain, model):
        attached = net is model
        optimizer = torch.optim.AdamW(net.parameters(), lr=LR)
        for ids in make_batches(5):
            net(input_ids=ids, labels=ids).loss.backward()
            if read == "no_grad":
                net.eval()
                with torch.no_grad():
                    seen[attached].append(net(input_ids=prompt).logits)
                net.train()
            elif read == "generate":
                out = net.generate(prompt[:, :3], max_new_tokens=4, do_sample=False, pad_token_id=0)
                seen[attached].append(out)
            else:
                weight = net.model.layers[1].mlp.up_proj.weight
                with autooffload.gathered(weight):
                    seen[attached].append(weight.detach().clone())
            optimizer.step()
            optimizer.zero_grad()
    runtime.synchronize()
    _assert_same_weights(model, plain)
    assert not runtime.backward_update.on
    for got, want in zip(seen[True], seen[False], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("setting", [False, True])
def test_the_setting_overrides_the_loop(make_llama, offload_cpu, make_batches, setting):
    """``False``: never on, even for a plain loop; ``True``: on from the first step, without
    looking (``test_update_in_backward.py`` covers the rest of the forced mode)."""
    _, model, runtime = _pair(make_llama, offload_cpu, update_in_backward=setting)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for ids in make_batches(3):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert runtime.backward_update.on is setting
    assert runtime.cpu_optim.in_backward.armed is setting


def test_a_trained_chunk_param_outside_the_optimizer_keeps_it_off(
    make_llama, offload_cpu, make_batches
):
    """The update in the backward steps persistent chunks with their params' optimizer, and the
    plan counts their gradients as dropped there: a trained param that no bound optimizer holds
    (here the persistent chunk's, left to the loop) keeps the mode off, and training exact."""
    plain, model, runtime = _pair(make_llama, offload_cpu)
    kept = {s.name for s in runtime.layout.chunks[0].trainable_slots}
    assert kept and 0 in runtime.manager.persistent
    for net in (plain, model):
        params = [p for name, p in net.named_parameters() if name not in kept]
        optimizer = torch.optim.AdamW(params, lr=LR)
        for ids in make_batches(4):
            net(input_ids=ids, labels=ids).loss.backward()
            if net is model:
                assert not runtime.cpu_optim.early.count
            optimizer.step()
            optimizer.zero_grad()
    runtime.synchronize()
    _assert_same_weights(model, plain)
    assert not runtime.backward_update.on


@pytest.mark.parametrize("phase", [0, 1], ids=["skips-odd-steps", "skips-even-steps"])
@pytest.mark.parametrize("n_persist", [0, None], ids=["offloaded", "searched-persistent"])
def test_an_optimizer_stepping_every_other_backward_trains_like_plain(
    make_llama, offload_cpu, make_batches, monkeypatch, phase, n_persist
):
    """Two optimizers, the second stepping every other backward: its params' gradients add up
    over two backward passes, which only its step can update from. The auto mode, even where
    the search would take the update in the backward, leaves them to step() and turns off."""
    from autooffload.runtime.update import update_mode

    monkeypatch.setattr(update_mode, "CHOOSE_GAIN", -10.0)  # the search takes it if on
    base = make_llama(n_layers=2, tied=False)
    runs = []
    for attached in (False, True):
        model = make_llama(n_layers=2, tied=False)
        model.load_state_dict(base.state_dict())
        if attached:
            offload_cpu(n_persist=n_persist)
            model.to("cpu")
        losses = train_two_optimizers(model, 6, every_other=phase)
        if attached:
            assert not rt.runtime_of(model).backward_update.on
        autooffload.disable()
        runs.append((losses, {k: v.clone() for k, v in model.state_dict().items()}))
    (plain_losses, plain), (losses, weights) = runs
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    for name, value in plain.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_zero_grad_keeping_zeros_keeps_it_on_over_persistent_chunks(
    make_llama, offload_cpu, make_batches
):
    """``zero_grad(set_to_none=False)`` leaves the persistent params zeros before the first
    backward that steps them early: no gradient a step has not used, so the mode stays on."""
    plain, model, runtime = _pair(make_llama, offload_cpu)
    assert runtime.manager.persistent
    for net in (plain, model):
        optimizer = torch.optim.AdamW(net.parameters(), lr=LR, fused=True)
        for ids in make_batches(4):
            net(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
    runtime.synchronize()
    assert runtime.backward_update.on
    _assert_same_weights(model, plain)
