"""The GPU update path (runtime/update/gpu_update.py) trains exactly like plain training.

On a CPU device the path runs its whole bookkeeping (the pinned state arena as the twin's state,
the scratch sets, weights, gradients, state and step counts copied in and out, clipping) on CPU
tensors with torch's fused Adam kernels, so a slip shows up as a weight that differs from plain
training on the same seed and data.
"""

from __future__ import annotations

import copy

import pytest
import torch

import autooffload
from autooffload.errors import PlanError
from autooffload.runtime.update.gpu_update import GpuUpdater
from tests.runtime.test_offload_equivalence import STEPS, assert_same_training, compare

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    ("accum", "clip", "tied"),
    [(1, None, True), (2, 0.5, False)],
    ids=["plain-tied", "accum2-clip-untied"],
)
def test_gpu_updated_chunks_train_like_plain(
    make_llama, make_batches, offload_cpu, chunk_count, gpu_updates, accum, clip, tied
):
    n_chunks = chunk_count(make_llama(tied=tied))
    assert n_chunks >= 3
    plain, offloaded, initial = compare(
        make_llama,
        make_batches,
        offload_cpu,
        model_kw={"tied": tied},
        n_data=accum * STEPS,
        accum=accum,
        clip=clip,
        attach={"n_persist": 0, "gpu_update_chunks": 2},
    )
    assert_same_training(plain, offloaded)
    # The last two chunks took the GPU path at every planned step, the others the CPU's.
    assert set(gpu_updates) == {n_chunks - 2, n_chunks - 1}, gpu_updates
    assert len(gpu_updates) >= 2 * (STEPS - 2)
    moved = max((plain.weights[k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-2


def test_adam_with_amsgrad_and_coupled_decay_trains_like_plain(
    make_llama, make_batches, offload_cpu, gpu_updates
):
    def adam(model):
        return torch.optim.Adam(
            model.parameters(), lr=1e-2, weight_decay=0.01, amsgrad=True, fused=True
        )

    plain, offloaded, _ = compare(
        make_llama,
        make_batches,
        offload_cpu,
        make_optimizer=adam,
        schedule=lambda step: 1.0 - step / (2 * STEPS),
        attach={"n_persist": 1, "gpu_update_chunks": 3},
    )
    assert_same_training(plain, offloaded)
    assert len(set(gpu_updates)) == 3


@pytest.mark.parametrize(
    ("setting", "attach"),
    [
        ("GPU_UPDATE_CHUNKS", {"gpu_update_chunks": 2}),
        ("GPU_UPDATE_IN_BACKWARD", {"update_in_backward": True, "gpu_update_in_backward": 2}),
    ],
    ids=["at-step", "in-backward"],
)
def test_gpu_update_setting_with_an_optimizer_it_cannot_run_is_a_clear_error(
    make_llama, make_batches, offload_cpu, setting, attach
):
    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    with pytest.raises(PlanError, match=rf"AUTOOFFLOAD_{setting}=2 .* SGD"):
        compare(
            make_llama,
            make_batches,
            offload_cpu,
            make_optimizer=sgd,
            attach={"n_persist": 0, **attach},
        )


def test_a_failed_update_is_raised_where_its_chunk_is_next_needed(
    make_llama, make_batches, offload_cpu, monkeypatch
):
    """A done future holding an exception is read too: the chunk is never used stale."""

    def fail(self, task, start):
        raise RuntimeError("update failed on purpose")

    monkeypatch.setattr(GpuUpdater, "_issue", fail)
    with pytest.raises(RuntimeError, match="update failed on purpose"):
        compare(
            make_llama,
            make_batches,
            offload_cpu,
            attach={"n_persist": 0, "gpu_update_chunks": 1},
        )


def test_gpu_update_setting_with_fp32_masters_is_a_clear_error(
    make_llama, make_batches, offload_cpu
):
    def bf16(model):
        model.to(torch.bfloat16)

    with pytest.raises(PlanError, match=r"GPU_UPDATE_CHUNKS=1 .* fp32 master weights"):
        compare(
            make_llama,
            make_batches,
            offload_cpu,
            prepare=bf16,
            attach={"n_persist": 0, "gpu_update_chunks": 1, "master_weights": True},
        )


# ---- the update in the backward: the lowest offloaded chunks on the GPU -----------------------


@pytest.mark.parametrize(
    ("tied", "n_persist"),
    [(True, 1), (False, 1), (True, 0)],
    ids=["tied", "untied", "tied-embedding-on-the-gpu-path"],
)
def test_chunks_updated_on_the_gpu_in_the_backward_train_like_plain(
    make_llama,
    make_batches,
    offload_cpu,
    chunk_count,
    resident_updates,
    gpu_updates,
    monkeypatch,
    tied,
    n_persist,
):
    """The lowest two offloaded chunks are updated in the backward from their resident
    weights and gradients (the state streamed in and out), the rest on the CPU as their
    gradients arrive; with an LR schedule and weight decay, the run equals plain training.
    Each chunk's state was copied in ahead, in an earlier group's pre-backward hook. With
    nothing persistent, the tied embedding's chunk (complete only at the backward's end) is
    one of them."""
    preloaded: list[bool] = []
    update = GpuUpdater.update_resident

    def checked(self, chunk, *args):
        preloaded.append(chunk.index in self.loaded)
        return update(self, chunk, *args)

    monkeypatch.setattr(GpuUpdater, "update_resident", checked)
    n_chunks = chunk_count(make_llama(tied=tied))
    assert n_chunks >= 4
    plain, offloaded, initial = compare(
        make_llama,
        make_batches,
        offload_cpu,
        model_kw={"tied": tied},
        schedule=lambda step: 1.0 - step / (2 * STEPS),
        attach={
            "n_persist": n_persist,
            "activation_mode": "keep",
            "update_in_backward": True,
            "gpu_update_in_backward": 2,
        },
    )
    assert_same_training(plain, offloaded)
    # The first step arms the update in the backward; every later one took the lowest two
    # offloaded chunks so.
    assert sorted(set(resident_updates)) == [n_persist, n_persist + 1], resident_updates
    assert len(resident_updates) == 2 * (STEPS - 1)
    assert gpu_updates == []  # not the step-time path
    assert preloaded and all(preloaded), preloaded
    moved = max((plain.weights[k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-2


def test_the_state_the_gpu_updates_in_the_backward_is_the_optimizers_state_of_record(
    make_llama, make_batches, offload_cpu, resident_updates
):
    """The user's ``optimizer.state_dict()`` reads the twins' state, which the GPU path keeps
    in its pinned arena: after training it equals a plain run's state."""
    from autooffload import runtime as rt

    base = make_llama()
    data = make_batches(4)
    states = []
    for attach in (None, {"n_persist": 1, "update_in_backward": True, "gpu_update_in_backward": 1}):
        model = copy.deepcopy(base)
        if attach is not None:
            offload_cpu(activation_mode="keep", **attach)
            model.to("cpu")
            assert rt.runtime_of(model) is not None
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        for ids in data:
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        states.append(optimizer.state_dict()["state"])
        if attach is not None:
            autooffload.disable()
    assert resident_updates, "the GPU path did not run"
    plain, attached = states
    assert plain.keys() == attached.keys()
    for key, state in plain.items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(attached[key][name], state[name], rtol=1e-5, atol=1e-6)


def test_a_second_backward_before_step_is_refused_for_gpu_updated_chunks(
    make_llama, make_batches, offload_cpu, resident_updates
):
    from autooffload import runtime as rt
    from autooffload.errors import UpdateInBackwardError

    model = make_llama()
    offload_cpu(
        n_persist=1, activation_mode="keep", update_in_backward=True, gpu_update_in_backward=3
    )
    model.to("cpu")
    assert rt.runtime_of(model) is not None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = make_batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()  # arms it
    optimizer.step()
    optimizer.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    assert resident_updates
    # The next micro-batch's forward would read the weights the backward updated: refused there.
    with pytest.raises(UpdateInBackwardError, match="forward of the attached model.*accumulate"):
        model(input_ids=ids, labels=ids).loss.backward()
    autooffload.disable()


def test_a_chunk_holding_two_optimizers_params_is_updated_on_the_worker(
    make_llama, make_batches, offload_cpu, gpu_updates
):
    """The GPU path writes its chunk's whole host bytes back: a chunk holding another
    optimizer's params too is updated on the worker, in order with that optimizer's update (on
    the GPU path it could write back their bytes from before it); a chunk one optimizer holds
    alone still takes the GPU path."""
    from autooffload import runtime as rt

    base = make_llama(tied=False)
    runs = []
    for attached in (False, True):
        model = copy.deepcopy(base)
        if attached:
            offload_cpu(n_persist=0, gpu_update_chunks=100, update_in_backward=0)
            model.to("cpu")
        norms = [p for n, p in model.named_parameters() if "norm" in n]
        rest = [p for n, p in model.named_parameters() if "norm" not in n]
        a = torch.optim.AdamW(norms, lr=1e-2, fused=True)
        b = torch.optim.AdamW(rest, lr=1e-2, fused=True)
        for ids in make_batches(STEPS):
            model(input_ids=ids, labels=ids).loss.backward()
            for optimizer in (a, b):
                optimizer.step()
                optimizer.zero_grad()
        if attached:
            runtime = rt.runtime_of(model)
            runtime.synchronize()
            mixed = {
                c.index
                for c in runtime.layout.chunks
                if len({any(s.param is p for p in norms) for s in c.trainable_slots}) == 2
            }
        runs.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        autooffload.disable()
    assert mixed and gpu_updates, "the model must have mixed chunks and GPU-updated ones"
    assert not mixed & set(gpu_updates), (mixed, gpu_updates)
    for name, value in runs[0].items():
        torch.testing.assert_close(runs[1][name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_step_without_a_backward_after_zero_grad_updates_nothing_on_the_gpu_path(
    make_llama, make_batches, offload_cpu, gpu_updates, slow_workers, set_to_none
):
    """A loop that skips a batch's backward but still steps: the step after ``zero_grad``
    must see the cleared gradients (none: nothing to update; zeros: AdamW's decay and
    momentum alone). The GPU path reads a chunk's host gradients after the worker's last task
    on them, which the clear queued by ``zero_grad`` is (read before it, the previous step's
    gradients were applied twice)."""
    slow_workers.prefixes = ("autooffload-cpu-optim",)
    slow_workers.delay_s = (0.02, 0.03)
    base = make_llama(tied=False)
    runs = []
    for attached in (False, True):
        model = copy.deepcopy(base)
        if attached:
            offload_cpu(n_persist=0, gpu_update_chunks=2)
            model.to("cpu")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        for step, ids in enumerate(make_batches(6)):
            if step % 3 != 2:
                model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)
        runs.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        autooffload.disable()
    assert gpu_updates
    for name, value in runs[0].items():
        torch.testing.assert_close(runs[1][name], value, rtol=1e-5, atol=1e-6, msg=name)
