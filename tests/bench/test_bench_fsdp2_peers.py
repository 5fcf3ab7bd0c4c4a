"""The two FSDP2-offload peers: the tuned one (fused CPU AdamW) and the one a script writes
(``AdamW(params, lr)``, which torch runs as a per-param for-loop on CPU DTensors)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from torch.optim.optimizer import _default_to_fused_or_foreach

from autooffload.bench.models import make_batch
from autooffload.bench.peers import PEERS, PeerContext, PeerUnavailable, public_peers
from autooffload.bench.workloads import get_workload


@pytest.fixture(autouse=True)
def _process_env() -> Iterator[None]:
    """The peers run in this process here (in the bench, in a worker): the single-process group
    env they set (RANK, WORLD_SIZE, ...) must not outlive the test, or HF Trainer and accelerate
    in later tests see a distributed launch."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _trainee(name: str, workload: str = "llama-tiny"):
    ctx = PeerContext(get_workload(workload), "cpu", None, seed=0)
    return PEERS[name].setup(ctx)


@pytest.mark.parametrize(
    ("name", "fused", "foreach"),
    [("fsdp2_offload", True, False), ("fsdp2_offload_default", False, False)],
)
def test_fsdp2_peers_differ_in_the_cpu_optimizer_kernel_only(
    name: str, fused: bool, foreach: bool
) -> None:
    assert name in public_peers()
    trainee = _trainee(name)
    try:
        params = [p for g in trainee.optimizer.param_groups for p in g["params"]]
        assert params and all(p.device.type == "cpu" for p in params)  # offloaded shards
        defaults = trainee.optimizer.defaults
        assert bool(defaults["fused"]) is fused
        if not fused:
            # What torch picks for these params when the script sets neither flag.
            assert defaults["foreach"] is None
            assert _default_to_fused_or_foreach(params, False) == (False, foreach)
        losses = [trainee.step(make_batch(get_workload("llama-tiny"))) for _ in range(3)]
        assert all(torch.isfinite(loss) for loss in losses)
        assert losses[-1] < losses[0]
    finally:
        trainee.close()


def test_fsdp2_default_peer_refuses_qlora_with_the_reason() -> None:
    workload = get_workload("llama-tiny-qlora")
    assert "4-bit" in PEERS["fsdp2_offload_default"].unavailable(workload, "cpu")
    with pytest.raises(PeerUnavailable, match="4-bit"):
        _trainee("fsdp2_offload_default", "llama-tiny-qlora")
