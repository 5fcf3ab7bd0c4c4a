"""Each data-parallel rank's share of its GPU's NUMA node (runtime/parallel/affinity.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from autooffload.runtime.parallel import affinity
from autooffload.runtime.parallel.affinity import (
    bind_threads,
    format_cpulist,
    parse_cpulist,
    plan_binding,
    share_of_node,
)


def fake_sysfs(root: Path, sockets: int, cores: int, smt: int) -> Path:
    """CPUs numbered as Linux does on a two-way SMT host: core c of socket s is CPU
    s * cores + c, its sibling that plus sockets * cores."""
    for thread in range(smt):
        for s in range(sockets):
            for c in range(cores):
                cpu = thread * sockets * cores + s * cores + c
                topology = root / f"devices/system/cpu/cpu{cpu}/topology"
                topology.mkdir(parents=True)
                (topology / "physical_package_id").write_text(f"{s}\n")
                (topology / "core_id").write_text(f"{c}\n")
    return root


def node(socket: int, cores: int, sockets: int = 2) -> frozenset[int]:
    first = socket * cores
    return frozenset(range(first, first + cores)) | frozenset(
        range(sockets * cores + first, sockets * cores + first + cores)
    )


def test_cpulists_parse_and_print_as_linux_writes_them():
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert format_cpulist(frozenset({0, 1, 2, 3, 8, 10, 11})) == "0-3,8,10-11"


def test_two_ranks_on_one_node_split_its_physical_cores_with_their_siblings(tmp_path):
    sysfs = fake_sysfs(tmp_path, sockets=2, cores=16, smt=2)
    four_gpus = [("host", node(g // 2, 16)) for g in range(4)]
    shares = [plan_binding(four_gpus[r], four_gpus, r, sysfs) for r in range(4)]
    assert [s.threads for s in shares] == [8, 8, 8, 8]
    assert [s.ranks_on_node for s in shares] == [2, 2, 2, 2]
    # Exclusive, and each within its GPU's node, hyperthread siblings together.
    assert shares[0].cpus == frozenset(range(0, 8)) | frozenset(range(32, 40))
    assert shares[1].cpus == frozenset(range(8, 16)) | frozenset(range(40, 48))
    assert shares[2].cpus == frozenset(range(16, 24)) | frozenset(range(48, 56))
    for a in range(4):
        assert shares[a].cpus <= four_gpus[a][1]
        for b in range(a + 1, 4):
            assert not shares[a].cpus & shares[b].cpus


def test_uneven_shares_and_ranks_of_other_hosts(tmp_path):
    sysfs = fake_sysfs(tmp_path, sockets=1, cores=5, smt=1)
    cpus = frozenset(range(5))
    assert [share_of_node(cpus, p, 3, sysfs).threads for p in range(3)] == [2, 2, 1]
    assert share_of_node(cpus, 0, 6, sysfs) is None  # fewer cores than ranks: no binding
    # Two nodes (hosts) of two ranks: each host's ranks split their own node.
    everyone = [("a", cpus), ("a", cpus), ("b", cpus), ("b", cpus)]
    assert plan_binding(everyone[3], everyone, 3, sysfs).cpus == frozenset({3, 4})
    assert plan_binding(("b", None), everyone, 3, sysfs) is None


def test_a_process_the_launcher_bound_is_left_alone(tmp_path, monkeypatch):
    sysfs = fake_sysfs(tmp_path, sockets=2, cores=2, smt=1)
    (sysfs / "devices/system/cpu/online").write_text("0-3\n")
    monkeypatch.setattr(affinity, "gpu_local_cpus", lambda device, sysfs: frozenset({0, 1}))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # bound by the launcher
    gathered = []

    def gather(value):
        gathered.append(value)
        return [value]

    assert affinity.bind_near_gpu(torch.device("cuda", 0), 0, gather, sysfs) is None
    assert gathered and gathered[0][1] is None  # still a collective: every rank gathers


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_binding_moves_every_thread_of_the_process():
    before = os.sched_getaffinity(0)
    target = frozenset({min(before)})
    try:
        assert bind_threads(target) >= 1
        assert os.sched_getaffinity(0) == target
    finally:
        bind_threads(frozenset(before))
    assert os.sched_getaffinity(0) == before
