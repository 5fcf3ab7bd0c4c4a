"""More than one node, simulated on one host: two ``torchrun`` agents (``--nnodes 2``, two ranks
each, rendezvous on localhost), so ``LOCAL_WORLD_SIZE`` (2) differs from ``WORLD_SIZE`` (4).
Training equals the four-rank single-node run bit for bit, and a checkpoint saved at world size 4
resumes at 4 and at 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dp_worker import resume_in_one_process
from torchrun import free_port
from torchrun import launch as launch_worker

WORKER = Path(__file__).with_name("multinode_worker.py")
# fp32 against the averaged reference: four ranks' all-reduce sums in another order than the
# reference's, and Adam amplifies the last bits over 10 steps (4e-5 measured on one node and on
# two alike); a gradient not averaged, or averaged twice, moves weights by ~lr = 1e-2.
TOL = 1e-4
WORLD = 4


def _two_nodes(out: Path) -> list[dict]:
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
                "--nproc-per-node=2",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                str(WORKER),
                f"--out={out}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
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


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[list[dict], list[dict], Path, Path]:
    single_out, multi_out = tmp_path_factory.mktemp("one_node"), tmp_path_factory.mktemp("nodes")
    single = launch_worker(WORKER, single_out, nproc=WORLD)
    return single, _two_nodes(multi_out), single_out, multi_out


def test_two_nodes_train_like_one_node_of_four_ranks(runs):
    single, multi, single_out, multi_out = runs
    assert [r["local_world_size"] for r in single] == [4] * WORLD
    assert [r["local_world_size"] for r in multi] == [2] * WORLD
    assert [r["node_rank"] for r in multi] == [0, 0, 1, 1]
    for report in multi:
        assert report["world"] == WORLD and report["sharding"]["sharded"]
        assert report["dp_vs_averaged"] < TOL and report["resume_vs_averaged"] < TOL
    one, two = (torch.load(o / "trained.pt", weights_only=True)["dp"] for o in runs[2:])
    for name, weight in one.items():
        assert torch.equal(two[name], weight), name


def test_a_checkpoint_of_two_nodes_resumes_in_one_process(runs):
    *_, multi_out = runs
    resumed = resume_in_one_process(multi_out / "world2.pt", WORLD)
    expected = torch.load(multi_out / "trained.pt", weights_only=True)["averaged"]
    for name, weight in expected.items():
        torch.testing.assert_close(resumed[name], weight, rtol=TOL, atol=TOL, msg=name)
