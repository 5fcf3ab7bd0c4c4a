"""More than one node, simulated on one host: two ``torchrun`` agents (``--nnodes 2``, two ranks
each, rendezvous on localhost), so ``LOCAL_WORLD_SIZE`` (2) differs from ``WORLD_SIZE`` (4).
Over gloo on the CPU, training equals the four-rank single-node run bit for bit; over NCCL on a
host of four GPUs (each rank on ``cuda:LOCAL_RANK``), within ``TOL`` of the single-node run on
the same four GPUs. A checkpoint saved at world size 4 resumes in one process (and, over NCCL,
on two GPUs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from dp_worker import resume_in_one_process
from torchrun import free_port
from torchrun import launch as launch_worker

WORKER = Path(__file__).with_name("multinode_worker.py")
# fp32 against the averaged reference: four ranks' all-reduce sums in another order than the
# reference's, and Adam amplifies the last bits over 10 steps (4e-5 measured over gloo on one
# node and on two alike); a gradient not averaged, or averaged twice, moves weights by ~lr = 1e-2.
# Over NCCL the two simulated nodes are held to the same bound against one node: NCCL joins the
# nodes over its network transport and sums in another order than within one node, a difference
# of the same kind.
TOL = 1e-4
WORLD = 4
PER_NODE = 2


class Runs(NamedTuple):
    """The reports and output folders of the single-node run and of the two simulated nodes."""

    single: list[dict]
    multi: list[dict]
    single_out: Path
    multi_out: Path


def _node_env(device: str, node: int) -> dict[str, str]:
    """What one agent adds to the environment. Over NCCL: its own two GPUs (its ranks on
    ``cuda:LOCAL_RANK`` of them), and a host id of its own, so NCCL takes the agents for two
    hosts and joins them over TCP on loopback, as over the network between two nodes."""
    if device == "cpu":
        return {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    return {
        "CUDA_VISIBLE_DEVICES": ",".join(gpus[node * PER_NODE : (node + 1) * PER_NODE]),
        "NCCL_HOSTID": f"autooffload-test-node-{node}",
        "NCCL_NET": "Socket",
        "NCCL_IB_DISABLE": "1",
        "NCCL_SOCKET_IFNAME": "lo",
    }


def _two_nodes(out: Path, device: str) -> list[dict]:
    """Two agents of two ranks each, started side by side as two nodes would be."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node-rank={node}",
                f"--nproc-per-node={PER_NODE}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                str(WORKER),
                f"--out={out}",
                f"--device={device}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**env, **_node_env(device, node)},
        )  # fmt: skip
        for node in range(2)
    ]
    outputs = [agent.communicate(timeout=600) for agent in agents]
    for agent, (_, stderr) in zip(agents, outputs):
        assert agent.returncode == 0, stderr[-4000:]
    reports = []
    for rank in range(WORLD):
        report = json.loads((out / f"rank{rank}.json").read_text())
        assert "error" not in report, report["error"]
        reports.append(report)
    return reports


def _runs(tmp_path_factory, device: str) -> Runs:
    single_out = tmp_path_factory.mktemp(f"one_node_{device}")
    multi_out = tmp_path_factory.mktemp(f"nodes_{device}")
    single = launch_worker(WORKER, single_out, f"--device={device}", nproc=WORLD)
    return Runs(single, _two_nodes(multi_out, device), single_out, multi_out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return _runs(tmp_path_factory, "cpu")


@pytest.fixture(scope="module")
def nccl_runs(tmp_path_factory) -> Runs:
    return _runs(tmp_path_factory, "cuda")


def check_nodes(runs: Runs) -> tuple[dict, dict]:
    """Every rank counts the host's ranks per node (``LOCAL_WORLD_SIZE``, which the host-memory
    check and the CPU threads divide by) and trains within ``TOL`` of the averaged reference,
    sharded over the whole world; the trained weights of one node and of two."""
    assert [r["local_world_size"] for r in runs.single] == [WORLD] * WORLD
    assert [r["local_world_size"] for r in runs.multi] == [PER_NODE] * WORLD
    assert [r["node_rank"] for r in runs.multi] == [0, 0, 1, 1]
    for report in runs.multi:
        assert report["world"] == WORLD and report["sharding"]["sharded"]
        assert report["dp_vs_averaged"] < TOL and report["resume_vs_averaged"] < TOL
    one, two = (
        torch.load(out / "trained.pt", weights_only=True)["dp"]
        for out in (runs.single_out, runs.multi_out)
    )
    return one, two


def check_resumes_in_one_process(runs: Runs) -> None:
    """The checkpoint the two nodes saved at world size 4 resumes in this process on the CPU."""
    resumed = resume_in_one_process(runs.multi_out / "world2.pt", WORLD)
    expected = torch.load(runs.multi_out / "trained.pt", weights_only=True)["averaged"]
    for name, weight in expected.items():
        torch.testing.assert_close(resumed[name], weight, rtol=TOL, atol=TOL, msg=name)


def test_two_nodes_train_like_one_node_of_four_ranks(runs):
    one, two = check_nodes(runs)
    for name, weight in one.items():
        assert torch.equal(two[name], weight), name


def test_a_checkpoint_of_two_nodes_resumes_in_one_process(runs):
    check_resumes_in_one_process(runs)


needs_four_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA devices"
)


@pytest.mark.multigpu
@needs_four_gpus
def test_two_nodes_over_nccl_train_like_one_node_of_four_gpus(nccl_runs):
    assert {r["backend"] for r in nccl_runs.single + nccl_runs.multi} == {"nccl"}
    one, two = check_nodes(nccl_runs)
    for name, weight in one.items():
        torch.testing.assert_close(two[name], weight, rtol=0, atol=TOL, msg=name)


@pytest.mark.multigpu
@needs_four_gpus
def test_a_checkpoint_of_two_nccl_nodes_resumes_in_one_process_and_on_2_gpus(nccl_runs, tmp_path):
    check_resumes_in_one_process(nccl_runs)
    checkpoint = nccl_runs.multi_out / "world2.pt"
    reports = launch_worker(
        WORKER, tmp_path, "--device=cuda", f"--resume-from={checkpoint}", nproc=PER_NODE
    )
    assert [(r["world"], r["backend"]) for r in reports] == [(PER_NODE, "nccl")] * PER_NODE
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    expected = torch.load(nccl_runs.multi_out / "trained.pt", weights_only=True)["averaged"]
    for name, weight in expected.items():
        torch.testing.assert_close(resumed[name], weight, rtol=TOL, atol=TOL, msg=name)
