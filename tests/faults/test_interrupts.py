"""An exception or Ctrl-C in the middle of forward or backward loses nothing: the chunks are
released, no copy or CPU task is left pending, the next step trains exactly like plain PyTorch
that met the same fault, and ``disable()`` returns the correctly trained model."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from _faults import (
    Boom,
    Fault,
    assert_same_weights,
    batches,
    enable_cpu,
    no_offloaded_grad_on_device,
    offloaded_chunks_on_host,
    tiny_llama,
    weights,
    worker_idle,
)
from torch.multiprocessing.reductions import StorageWeakRef

import autooffload
from autooffload import runtime as rt
from autooffload.errors import UpdateInBackwardError
from autooffload.runtime.step_state import StepPhase

STEPS = 6
FAIL_AT = 3


def train_through_fault(
    model: torch.nn.Module,
    where: str,
    kind: type[BaseException],
    then: str,
    attach: dict | None,
    accum: int = 1,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train ``STEPS`` steps; the batch ``FAIL_AT`` raises once; after it the loop does
    ``then``: ``zero_grad`` (skip the batch), ``step`` (step on what there is), or ``nothing``."""
    runtime = None
    if attach is not None:
        enable_cpu(**attach)
        model.to("cpu")
        runtime = rt.runtime_of(model)
        assert runtime is not None
    fault = Fault(model.model.layers[1].mlp, where, kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    data = batches(STEPS * accum)
    losses = []
    for step in range(STEPS):
        failed = False
        for micro in range(accum):
            index = step * accum + micro
            fault.armed = index == FAIL_AT
            try:
                loss = model(input_ids=data[index], labels=data[index]).loss / accum
                loss.backward()
                losses.append(loss.item())
            except (Boom, KeyboardInterrupt):
                failed = True
        if failed and then == "zero_grad":
            optimizer.zero_grad()
        elif failed and then == "nothing":
            pass
        else:
            optimizer.step()
            optimizer.zero_grad()
        if failed and runtime is not None and then != "nothing":
            assert offloaded_chunks_on_host(runtime), [s.value for s in runtime.manager.state]
            assert no_offloaded_grad_on_device(runtime)
            assert runtime.step_state.phase is StepPhase.IDLE
            assert worker_idle(runtime)
    assert not fault.armed, "the fault was never injected"
    if runtime is not None:
        worker = runtime.cpu_optim.worker
        autooffload.disable()
        assert rt.runtime_of(model) is None
        assert not any(t.is_alive() for t in worker._threads), "CPU optimizer thread not joined"
    return losses, weights(model)


# The update at step(): a step skipped after a fault updates nothing. (With the update in the
# backward, the auto mode's pick for these plain loops, part of the step has run by then:
# ``test_under_the_update_in_the_backward_only_a_step_completes_an_interrupted_one``.)
AT_STEP = {"update_in_backward": False}
SETTINGS = {
    "none-persistent": {"n_persist": 0, "activation_mode": "keep", **AT_STEP},
    "one-persistent-checkpointed": {"n_persist": 1, "activation_mode": "checkpoint", **AT_STEP},
    # No knobs: the fault hits the profiling steps, then the searched plan takes over.
    "auto-plan": AT_STEP,
}


@pytest.mark.parametrize("then", ["zero_grad", "step", "nothing"])
@pytest.mark.parametrize("kind", [Boom, KeyboardInterrupt], ids=["exception", "ctrl-c"])
@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("settings", list(SETTINGS.values()), ids=list(SETTINGS))
def test_fault_then_training_matches_plain(settings, where, kind, then):
    base = tiny_llama()
    plain = train_through_fault(copy.deepcopy(base), where, kind, then, attach=None)
    attached = train_through_fault(copy.deepcopy(base), where, kind, then, attach=settings)
    torch.testing.assert_close(torch.tensor(attached[0]), torch.tensor(plain[0]))
    assert_same_weights(plain[1], attached[1])
    initial = weights(base)
    moved = max((plain[1][k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-2, "the reference did not train; the comparison proves nothing"


@pytest.mark.parametrize("kind", [Boom, KeyboardInterrupt], ids=["exception", "ctrl-c"])
def test_under_the_update_in_the_backward_only_a_step_completes_an_interrupted_one(kind):
    """The auto mode turns the update in the backward on for this loop, so the chunks whose
    gradients were done before the fault are updated already: ``step()`` then applies the rest,
    exactly as plain torch steps on the partial gradients; skipping the step is an error that
    says so (plain torch would have updated nothing); ``disable()`` warns that the weights
    hold part of a step."""
    base = tiny_llama()
    settings = {"n_persist": 1, "activation_mode": "keep"}
    plain = train_through_fault(copy.deepcopy(base), "backward", kind, "step", attach=None)
    attached = train_through_fault(copy.deepcopy(base), "backward", kind, "step", settings)
    assert_same_weights(plain[1], attached[1])
    with pytest.raises(UpdateInBackwardError, match=r"optimizer.step\(\) applies the rest"):
        train_through_fault(copy.deepcopy(base), "backward", kind, "zero_grad", settings)
    with pytest.warns(UserWarning, match="include that part of a step"):
        autooffload.disable()
    model = copy.deepcopy(base)
    enable_cpu(**settings)
    model.to("cpu")
    fault = Fault(model.model.layers[1].mlp, "backward", kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for ids in batches(2):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    fault.armed = True
    with pytest.raises(kind):
        model(input_ids=ids, labels=ids).loss.backward()
    assert rt.runtime_of(model).cpu_optim.early.offloaded
    with pytest.warns(UserWarning, match="include that part of a step"):
        autooffload.disable()


@pytest.mark.parametrize("kind", [Boom, KeyboardInterrupt], ids=["exception", "ctrl-c"])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_fault_in_a_micro_batch_of_gradient_accumulation(where, kind):
    """The failed micro-batch is skipped and the step uses the others (and, as in plain
    torch, whatever partial gradients the failed backward produced)."""
    base = tiny_llama(tied=False)
    settings = {"n_persist": 1, "activation_mode": "keep"}
    plain = train_through_fault(copy.deepcopy(base), where, kind, "step", None, accum=2)
    attached = train_through_fault(copy.deepcopy(base), where, kind, "step", settings, accum=2)
    assert_same_weights(plain[1], attached[1])


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_exception_leaves_chunks_released_at_once(where):
    """An exception (not Ctrl-C, which skips torch's always-call hooks) is cleaned up as it
    leaves the model or ``backward()``: nothing waits for the next call into autooffload."""
    model = tiny_llama()
    enable_cpu(n_persist=1, activation_mode="keep")
    model.to("cpu")
    runtime = rt.runtime_of(model)
    fault = Fault(model.model.layers[1].mlp, where, Boom)
    ids = batches(1)[0]
    fault.armed = True
    with pytest.raises(Boom):
        model(input_ids=ids, labels=ids).loss.backward()
    assert offloaded_chunks_on_host(runtime)
    assert no_offloaded_grad_on_device(runtime)
    assert runtime.step_state.phase is StepPhase.IDLE
    assert worker_idle(runtime)


@pytest.mark.parametrize("kind", [Boom, KeyboardInterrupt], ids=["exception", "ctrl-c"])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_disable_right_after_a_fault_returns_the_trained_model(where, kind):
    base = tiny_llama()
    data = batches(3)
    runs = []
    for attach in (False, True):
        model = copy.deepcopy(base)
        if attach:
            enable_cpu(n_persist=1, activation_mode="keep", **AT_STEP)
            model.to("cpu")
        fault = Fault(model.model.layers[1].mlp, where, kind)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        for ids in data[:2]:
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        fault.armed = True
        with pytest.raises(kind):
            model(input_ids=data[2], labels=data[2]).loss.backward()
        autooffload.disable()
        assert all(not p.is_pinned() for p in model.parameters())
        runs.append(weights(model))
        # The returned model is an ordinary one: it runs forward and backward on its own.
        model(input_ids=data[0], labels=data[0]).loss.backward()
    assert_same_weights(*runs)


@pytest.mark.parametrize(
    "kind", [None, Boom, KeyboardInterrupt], ids=["no-fault", "exception", "ctrl-c"]
)
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_disable_frees_the_host_store_without_waiting_for_gc(where, kind):
    """``disable()`` drops every reference to the host store and the gradient staging, so the
    (pinned, on a GPU) memory is freed at once: with the cyclic gc off, nothing the runtime
    built keeps it alive, whether or not a fault interrupted a step."""
    model = tiny_llama()
    enable_cpu(n_persist=1, activation_mode="swap", **AT_STEP)
    model.to("cpu")
    runtime = rt.runtime_of(model)
    manager = runtime.manager
    stores = [StorageWeakRef(piece.untyped_storage()) for piece in manager.host.pieces]
    fault = Fault(model.model.layers[1].mlp, where, kind or Boom)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    gc.collect()
    gc.disable()
    try:
        for step, ids in enumerate(batches(4)):
            fault.armed = kind is not None and step == 2
            try:
                model(input_ids=ids, labels=ids).loss.backward()
            except (Boom, KeyboardInterrupt):
                optimizer.zero_grad()
                continue
            optimizer.step()
            optimizer.zero_grad()
        # The staging is allocated at the first gradient offloaded (``HostArena(lazy=True)``).
        assert manager.grads.staging.allocated
        stores += [StorageWeakRef(p.untyped_storage()) for p in manager.grads.staging.pieces]
        assert not any(ref.expired() for ref in stores)
        autooffload.disable()
        del runtime, manager
        assert all(ref.expired() for ref in stores), "host store alive after disable()"
    finally:
        gc.enable()


def test_a_failed_forwards_swapped_tensors_are_not_brought_back_by_the_next_backward():
    """The partial graph of a forward that raised lives on in the traceback (an OOM retry runs
    inside the handler); the next backward brings back its own swapped tensors only."""
    model = tiny_llama()
    enable_cpu(n_persist=1, activation_mode="swap")
    model.to("cpu")
    runtime = rt.runtime_of(model)
    swapper = runtime.activations.swapper
    swapper.min_swap_bytes = 0  # the tiny model's activations are all small
    fault = Fault(model.model.layers[2].mlp, "forward", Boom)
    ids = batches(1)[0]
    fault.armed = True
    try:
        model(input_ids=ids, labels=ids)
    except Boom as error:
        failed = error  # keeps the traceback, and with it the partial graph, alive
    swapper.reset_stats()
    model(input_ids=ids, labels=ids).loss.backward()
    assert failed.__traceback__ is not None
    counters = swapper.stats()
    assert counters["d2h_bytes"] > 0, "nothing was swapped: the check is moot"
    assert counters["h2d_bytes"] == counters["d2h_bytes"], counters
