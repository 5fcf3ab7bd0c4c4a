"""HF ``Trainer`` and an ``accelerate`` loop under ``torchrun --nproc-per-node 2`` (gloo DDP on
CPU): the attached model is wrapped by their DDP as a pass-through, autooffload averages the
gradients, and training equals the plain DDP run, with identical replicas on both ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from torchrun import launch

WORKER = Path(__file__).with_name("trainer_dp_worker.py")


@pytest.mark.slow
def test_trainer_ddp_over_an_attached_model_matches_plain_trainer_ddp(tmp_path):
    for report in launch(WORKER, tmp_path):
        assert report["attached"] and report["data_parallel"]
        assert report["wrapper"] == "DistributedDataParallel" and report["pass_through"]
        # Same fp32 math (mean of two ranks' gradients, clipping, AdamW): last-bit noise only.
        assert report["max_diff_vs_plain_ddp"] < 1e-5
        assert report["ranks_identical"]
        # accelerate: prepare (DDP), accumulate(2) with its no_sync, clip_grad_norm_, step.
        assert report["accelerate_max_diff_vs_plain"] < 1e-5
        # save_state of the sharded run: every param's optimizer state, in torch's layout.
        plain_count, attached_count = report["saved_state_params"]
        assert attached_count == plain_count > 0
        assert report["saved_state_max_diff"] < 1e-5


@pytest.mark.slow
def test_trainer_and_accelerate_under_torchrun_with_one_process(tmp_path):
    """``torchrun --nproc-per-node 1``: Trainer and accelerate still wrap the model in DDP (a
    group of one rank). DDP's start-up broadcast read the offloaded params' released storage
    and segfaulted; the wrapper is now a pass-through with nothing to average."""
    (report,) = launch(WORKER, tmp_path, nproc=1)
    assert report["attached"] and not report["data_parallel"]
    assert report["wrapper"] == "DistributedDataParallel" and report["pass_through"]
    assert report["max_diff_vs_plain_ddp"] < 1e-5
    assert report["accelerate_max_diff_vs_plain"] < 1e-5
    plain_count, attached_count = report["saved_state_params"]
    assert attached_count == plain_count > 0
    assert report["saved_state_max_diff"] < 1e-5
