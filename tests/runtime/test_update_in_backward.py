"""AUTOOFFLOAD_UPDATE_IN_BACKWARD: offloaded chunks updated as their gradients arrive.

Exact for loops that step after every backward without clipping, a GradScaler or
hyperparameter changes in between; every other loop gets ``UpdateInBackwardError`` the moment
it does something only an update at ``step()`` could honour.
"""

from __future__ import annotations

import threading

import pytest
import torch

import autooffload
from autooffload import runtime as rt
from autooffload.errors import AttachError, UpdateInBackwardError

pytestmark = pytest.mark.usefixtures("one_thread")


def _attached(make_llama, offload_cpu, **settings):
    torch.manual_seed(0)
    plain = make_llama(n_layers=2)
    model = make_llama(n_layers=2)
    model.load_state_dict(plain.state_dict())
    offload_cpu(n_persist=1, activation_mode="keep", update_in_backward=True, **settings)
    model.to("cpu")
    return plain, model, rt.runtime_of(model)


def _armed(make_llama, offload_cpu, make_batches):
    """An attached model after one plain step (the step that arms the setting)."""
    _, model, runtime = _attached(make_llama, offload_cpu)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = make_batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, runtime, optimizer, ids


def test_updates_run_in_the_backward_and_training_equals_plain(
    make_llama, offload_cpu, make_batches
):
    plain, model, runtime = _attached(make_llama, offload_cpu)
    offloaded = [
        c.index for c in runtime.layout.chunks if c.index not in runtime.manager.persistent
    ]
    assert offloaded, "the test needs offloaded chunks"
    pairs = []
    for net in (plain, model):
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        pairs.append((net, optimizer, schedule))
    early_counts, persistent = [], []
    for ids in make_batches(5):
        for net, optimizer, schedule in pairs:
            net(input_ids=ids, labels=ids).loss.backward()
            if net is model:
                early_counts.append(sorted(runtime.cpu_optim.early.offloaded))
                persistent.append(sorted(runtime.cpu_optim.early.persistent))
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
    # The first step arms it; every later backward queued each offloaded chunk's update and
    # stepped the persistent chunk (runtime/update/persistent_update.py).
    assert early_counts[0] == [] and all(c == offloaded for c in early_counts[1:]), early_counts
    assert persistent == [[]] + [sorted(runtime.manager.persistent)] * 4, persistent
    runtime.synchronize()
    reference = plain.state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6, msg=name)


def test_the_update_starts_before_step(make_llama, offload_cpu, make_batches):
    """The point of the setting: by the time backward returns, the updates are queued and run
    without step() (the worker is let go before step is called)."""
    model, runtime, optimizer, ids = _armed(make_llama, offload_cpu, make_batches)
    runtime.synchronize()
    before = runtime.cpu_optim.updates
    n_offloaded = sum(c.index not in runtime.manager.persistent for c in runtime.layout.chunks)
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(runtime.cpu_optim.early.offloaded) == n_offloaded
    done = threading.Event()
    runtime.cpu_optim.worker.submit(done.set)
    assert done.wait(30)
    assert runtime.cpu_optim.updates == before + n_offloaded, "not updated before step()"
    optimizer.step()
    runtime.synchronize()
    assert runtime.cpu_optim.updates == before + n_offloaded, "step() updated them again"
    assert not runtime.cpu_optim.early.offloaded


@pytest.mark.parametrize(
    "misuse", ["clip", "scaler", "accumulate", "lr_change", "skip_step", "eval", "gathered"]
)
def test_a_loop_it_cannot_honour_gets_a_clear_error(make_llama, offload_cpu, make_batches, misuse):
    model, _, optimizer, ids = _armed(make_llama, offload_cpu, make_batches)
    model(input_ids=ids, labels=ids).loss.backward()  # armed: updates queued in here
    with pytest.raises(UpdateInBackwardError, match="AUTOOFFLOAD_UPDATE_IN_BACKWARD"):
        if misuse == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        elif misuse == "scaler":
            scaler = torch.amp.GradScaler("cpu")
            scaler.scale(torch.ones(()))  # as scaler.scale(loss).backward() would have
            scaler.unscale_(optimizer)
        elif misuse == "accumulate":
            model(input_ids=ids, labels=ids).loss.backward()
        elif misuse == "eval":  # would see weights the backward already updated
            with torch.no_grad():
                model(input_ids=ids)
        elif misuse == "gathered":
            with autooffload.gathered(model):
                pass
        elif misuse == "lr_change":
            optimizer.param_groups[0]["lr"] = 5e-3
            optimizer.step()
        else:
            optimizer.zero_grad()


def test_it_refuses_to_combine_with_the_oom_retry(make_llama, offload_cpu):
    model = make_llama(n_layers=2)
    offload_cpu(n_persist=1, update_in_backward=True, oom_retry=True)
    with pytest.raises(AttachError, match="AUTOOFFLOAD_UPDATE_IN_BACKWARD=1"):
        model.to("cpu")
    autooffload.disable()


def test_persistent_updates_in_the_backward_are_timed_for_the_calibration(
    make_llama, offload_cpu, make_batches
):
    """Under the update in the backward the persistent chunk is stepped as its backward ends,
    not at ``step()``: the calibration's device-update timer times it there (one span a step,
    its trainable params), and the user's ``step()``, with no device gradient left, adds none."""
    model, runtime, optimizer, ids = _armed(make_llama, offload_cpu, make_batches)
    assert runtime.cpu_optim.in_backward.persistent_armed
    schedule = runtime.control.calibration
    schedule.arm(runtime, runtime.plan, after=100)
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    timer = schedule.device_update
    persistent = [c for c in runtime.layout.chunks if c.index in runtime.manager.persistent]
    numel = sum(s.param.numel() for c in persistent for s in c.trainable_slots)
    assert timer is not None and [n for _, _, n in timer.spans] == [numel, numel]
    assert timer.rate() is not None and timer.rate() > 0
