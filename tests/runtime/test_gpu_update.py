"""The GPU update path (runtime/gpu_update.py) trains exactly like plain training.

On a CPU device the path runs its whole bookkeeping (the pinned state arena as the twin's state,
the scratch sets, weights, gradients, state and step counts copied in and out, clipping) on CPU
tensors with torch's fused Adam kernels, so a slip shows up as a weight that differs from plain
training on the same seed and data.
"""

from __future__ import annotations

import pytest
import torch

from autooffload.errors import PlanError
from autooffload.runtime.gpu_update import GpuUpdater
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


def test_gpu_update_setting_with_an_optimizer_it_cannot_run_is_a_clear_error(
    make_llama, make_batches, offload_cpu
):
    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    with pytest.raises(PlanError, match=r"AUTOOFFLOAD_GPU_UPDATE_CHUNKS=2 .* SGD"):
        compare(
            make_llama,
            make_batches,
            offload_cpu,
            make_optimizer=sgd,
            attach={"n_persist": 0, "gpu_update_chunks": 2},
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
