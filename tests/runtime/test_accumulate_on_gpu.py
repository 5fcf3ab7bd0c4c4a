"""Gradient accumulation summed on the device (``accumulate_on="gpu"``) trains like plain torch.

The CPU simulation runs the path on CPU tensors: the running sum in the pinned staging is added
to the next backward's gradients before they go out (``GradientOffload.offload_grads``), the staging
stays the host gradient, and the CPU worker adds nothing. Any slip (a sum added twice, a first
gradient added to stale staging, a norm of one micro-batch taken for the sum's) moves the
weights by ~lr.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_offload_equivalence import STEPS, Run, adamw, assert_same_training, train

from autooffload import runtime as rt
from autooffload.errors import PlanError

pytestmark = pytest.mark.usefixtures("one_thread")


def _train(model, data, accum, attach, offload_cpu, clip, set_to_none, skip) -> tuple[Run, dict]:
    """``len(data) // accum`` steps; in the first micro-batch of every step the ``skip`` module's
    output is detached, so its weights get no gradient there (a later one brings their first)."""
    stats: dict = {}
    first = {"on": False}
    handle = model.get_submodule(skip).register_forward_hook(
        lambda m, i, out: out.detach() if first["on"] else out
    )

    def keep_stats(runtime) -> None:
        runtime.cpu_optim.wait()  # the last micro-batches' adds may still be on the worker
        stats.update(runtime.manager.stats)
        stats["added_params"] = runtime.cpu_optim.staging.added_params
        stats["copied_params"] = runtime.cpu_optim.staging.copied_params
        stats["on_gpu"] = runtime.cpu_optim.staging.accumulate_on_gpu

    run = train(
        model,
        data,
        attach=attach,
        offload_cpu=offload_cpu,
        accum=accum,
        clip=clip,
        set_to_none=set_to_none,
        before_micro=lambda micro: first.update(on=micro == 0),
        before_detach=keep_stats,
    )
    handle.remove()
    return run, stats


@pytest.mark.parametrize(
    ("clip", "set_to_none"),
    [(None, True), (0.5, True), (0.5, False)],
    ids=["plain", "clip", "zero"],
)
def test_sums_added_on_the_device_train_like_plain(
    make_llama, make_batches, offload_cpu, clip, set_to_none
):
    base = make_llama()
    accum = 3
    data = make_batches(accum * STEPS // 2)
    skip = "model.layers.1.mlp.down_proj"
    args = (accum, None, offload_cpu, clip, set_to_none, skip)
    plain, _ = _train(copy.deepcopy(base), data, *args)
    attach = {"n_persist": 1, "accumulate_on": "gpu"}
    summed, stats = _train(copy.deepcopy(base), data, accum, attach, *args[2:])
    on_cpu, cpu_stats = _train(
        copy.deepcopy(base), data, accum, {"n_persist": 1, "accumulate_on": "cpu"}, *args[2:]
    )
    assert stats["on_gpu"] and not cpu_stats["on_gpu"]
    # Every later micro-batch's offloaded gradients were summed on the device, none on the host.
    assert stats["added_params"] == 0 and stats["summed_params"] > 0
    assert cpu_stats["summed_params"] == 0 and cpu_stats["added_params"] > 0
    if set_to_none:
        # The same elements (zeroed gradients the host adds to are new ones for the device).
        adds = cpu_stats["added_params"] - cpu_stats["copied_params"]
        assert cpu_stats["copied_params"] > 0 and stats["summed_params"] == adds
    if clip is not None:
        assert max(plain.norms) > clip, "clipping never scaled anything; pick a smaller max_norm"
    assert_same_training(plain, summed)
    assert_same_training(plain, on_cpu)


def test_the_norm_for_clipping_is_the_norm_of_the_sum_without_a_host_pass(
    make_llama, make_batches, offload_cpu, monkeypatch
):
    """The device takes each param's norm after adding the sum: clipping reads those, not the
    host gradients (``HostGradNorms._local_norm``)."""
    offload_cpu(n_persist=0, accumulate_on="gpu")
    model = make_llama().to("cpu")
    runtime = rt.runtime_of(model)
    optimizer = adamw(model.parameters())
    for ids in make_batches(3):
        model(input_ids=ids, labels=ids).loss.backward()
    cpu_optim = runtime.cpu_optim
    norms = cpu_optim.grad_norms
    assert norms.whole_norms and all(
        cpu_optim.staging.accumulations[p] == 3 for p in norms.whole_norms
    )
    host = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g) for g in norms.host_grads()])
    )
    reads = []
    real = torch.linalg.vector_norm
    monkeypatch.setattr(
        torch.linalg, "vector_norm", lambda t, *a, **k: reads.append(t.numel()) or real(t, *a, **k)
    )
    norm = norms.host_grad_norm(2.0, set(cpu_optim.offloaded_ids))
    monkeypatch.undo()
    # One norm over the per-param norms (one per param), none over a host gradient.
    assert reads == [len(norms.whole_norms)]
    torch.testing.assert_close(norm, host, rtol=1e-5, atol=0)
    optimizer.zero_grad()
    assert not norms.whole_norms


def test_asking_for_it_where_it_cannot_run_is_a_clear_error(make_llama, offload_cpu):
    """fp32 masters keep fp32 host gradients of a bf16 model: nothing the device sums into."""
    offload_cpu(n_persist=0, accumulate_on="gpu", master_weights=True)
    with pytest.raises(PlanError, match="AUTOOFFLOAD_ACCUMULATE_ON=gpu.*master weights"):
        make_llama().to(torch.bfloat16).to("cpu")


def test_on_auto_a_cpu_device_accumulates_on_the_cpu(make_llama, make_batches, offload_cpu):
    offload_cpu(n_persist=1)
    model = make_llama().to("cpu")
    runtime = rt.runtime_of(model)
    for ids in make_batches(2):
        model(input_ids=ids, labels=ids).loss.backward()
    staging = runtime.cpu_optim.staging
    assert not staging.accumulate_on_gpu
    assert runtime.manager.stats["summed_params"] == 0 and staging.added_params > 0


@pytest.mark.parametrize("where", ["cpu", "gpu"], ids=["on-host", "on-device"])
def test_the_next_micro_batchs_forward_frees_the_staging_only_on_the_cpu(
    make_llama, make_batches, offload_cpu, where
):
    """On the CPU the host gradients leave the staging while the next micro-batch's forward runs
    (not when its backward needs the staging); on the GPU the staging keeps the sums."""
    offload_cpu(n_persist=0, accumulate_on=where)
    model = make_llama().to("cpu")
    cpu_optim = rt.runtime_of(model).cpu_optim
    first, second = make_batches(2)
    model(input_ids=first, labels=first).loss.backward()
    aliased = set(cpu_optim.staging.aliased)
    assert aliased
    seen = []
    block = model.model.layers[0]
    handle = block.register_forward_pre_hook(
        lambda m, a: seen.append(set(cpu_optim.staging.aliased))
    )
    model(input_ids=second, labels=second).loss.backward()
    handle.remove()
    assert seen[0] == (set() if where == "cpu" else aliased)


def test_copies_out_of_the_staging_count_with_the_adds_not_the_update(
    make_llama, make_batches, offload_cpu
):
    """The cost model charges the copy of the first micro-batch's gradients out of the staging
    at the add rate (``cost_time.later_on_cpu``): the worker's clocks must put it there too, or the
    update's measured rate drops by the copy (3.6B: 3.8 against 5.3 Gparam/s) and it is paid
    twice in the predicted step."""
    from autooffload.runtime.control.calibration import accumulate_rate, worker_rate

    offload_cpu(n_persist=0, accumulate_on="cpu")
    model = make_llama().to("cpu")
    cpu_optim = rt.runtime_of(model).cpu_optim
    (ids,) = make_batches(1)
    model(input_ids=ids, labels=ids).loss.backward()
    cpu_optim.wait()
    assert cpu_optim.staging.aliased and not cpu_optim.staging.grad_buffers
    mark = cpu_optim.mark()
    cpu_optim.staging.release_staging()
    cpu_optim.wait()
    busy_s, updated, add_s, added = cpu_optim.mark()
    copied = sum(buffer.numel() for buffer in cpu_optim.staging.grad_buffers.values())
    assert copied > 0 and added - mark[3] == copied == cpu_optim.staging.copied_params
    assert add_s - mark[2] == pytest.approx(busy_s - mark[0])
    assert updated == mark[1] and worker_rate(mark, cpu_optim) is None
    assert accumulate_rate(mark, cpu_optim) > 0
