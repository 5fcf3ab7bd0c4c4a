"""Each data-parallel rank's CPU cores: those of its GPU's NUMA node, shared out among its ranks.

Ranks on one host share its memory channels and cores. A rank whose threads and pinned host
memory sit on the other socket than its GPU copies through the inter-socket link, and its CPU
update (memory-bound fp32 AdamW) reads remote memory; unbound, the kernel moves four ranks'
optimizer teams across all cores, each team spreading over the others'. ``bind_near_gpu``
(``AUTOOFFLOAD_CPU_BINDING=auto``, under torchrun with several ranks on a multi-node host)
gives each rank an exclusive share of the physical cores of its GPU's NUMA node (the ranks
whose GPUs sit on one node split its cores evenly, in rank order), binds every thread of the
process to them, and sizes the optimizer's thread team to that share. It runs at attach, before
the host store and optimizer state are allocated, so their pages land on that node (Linux's
first-touch policy). A process the launcher already restricted (``torchrun --numa-binding``,
``numactl``, SLURM's ``--cpu-bind``) is left as it is.

The topology comes from sysfs: a GPU's node's CPUs from its PCI device's ``local_cpulist``, a
logical CPU's core from ``topology/core_id`` and ``physical_package_id``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from autooffload.log import logger

SYSFS = Path("/sys")


def parse_cpulist(text: str) -> frozenset[int]:
    """``"0-3,8,10-11"`` -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def gpu_local_cpus(device: torch.device, sysfs: Path = SYSFS) -> frozenset[int] | None:
    """The logical CPUs of the NUMA node of CUDA ``device``'s PCI slot; None if unknown."""
    props = torch.cuda.get_device_properties(device)
    try:
        address = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        text = (sysfs / "bus/pci/devices" / address / "local_cpulist").read_text()
    except (AttributeError, OSError):
        return None
    return parse_cpulist(text) or None


def physical_cores(cpus: frozenset[int], sysfs: Path = SYSFS) -> list[tuple[int, ...]]:
    """``cpus`` grouped by physical core (hyperthread siblings together), ordered by their
    lowest CPU; a CPU whose topology cannot be read is a core of its own."""
    cores: dict[tuple[str, str], list[int]] = {}
    for cpu in sorted(cpus):
        topology = sysfs / f"devices/system/cpu/cpu{cpu}/topology"
        try:
            key = (
                (topology / "physical_package_id").read_text().strip(),
                (topology / "core_id").read_text().strip(),
            )
        except OSError:
            key = ("cpu", str(cpu))
        cores.setdefault(key, []).append(cpu)
    return sorted((tuple(c) for c in cores.values()), key=lambda core: core[0])


@dataclass(frozen=True)
class Binding:
    """The CPUs one rank runs on, and the optimizer threads it uses (its physical cores)."""

    cpus: frozenset[int]
    threads: int
    node_cpus: frozenset[int]
    ranks_on_node: int


def share_of_node(
    node_cpus: frozenset[int], position: int, ranks_on_node: int, sysfs: Path = SYSFS
) -> Binding | None:
    """The ``position``-th of ``ranks_on_node`` even shares of the node's physical cores (the
    remainder to the first shares); None if the node has fewer cores than ranks."""
    cores = physical_cores(node_cpus, sysfs)
    if len(cores) < ranks_on_node:
        return None
    base, extra = divmod(len(cores), ranks_on_node)
    start = position * base + min(position, extra)
    mine = cores[start : start + base + (1 if position < extra else 0)]
    cpus = frozenset(cpu for core in mine for cpu in core)
    return Binding(cpus, len(mine), node_cpus, ranks_on_node)


def plan_binding(
    mine: tuple[str, frozenset[int] | None],
    everyone: list[tuple[str, frozenset[int] | None]],
    rank: int,
    sysfs: Path = SYSFS,
) -> Binding | None:
    """This rank's share, from every rank's (hostname, its GPU's node CPUs) in rank order:
    the ranks of this host whose GPUs share this rank's node split it, in rank order."""
    host, node = mine
    if node is None:
        return None
    peers = [r for r, (h, n) in enumerate(everyone) if h == host and n == node]
    return share_of_node(node, peers.index(rank), len(peers), sysfs)


def bind_threads(cpus: frozenset[int]) -> int:
    """Bind every thread of this process (OpenMP's team included) to ``cpus``; threads started
    later inherit it. Returns how many threads were bound."""
    bound = 0
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
            bound += 1
        except OSError:
            pass  # a thread that ended meanwhile
    return bound


def bind_near_gpu(
    device: torch.device,
    rank: int,
    gather: Callable[[tuple[str, frozenset[int] | None]], list],
    sysfs: Path = SYSFS,
) -> Binding | None:
    """Collective (``gather``: every rank's value in rank order, on every rank): bind this rank
    to its share of its GPU's NUMA node and size torch's thread team to it; None (nothing
    changed) where the launcher bound the process already, or the topology is unknown."""
    allowed = frozenset(os.sched_getaffinity(0))
    node = gpu_local_cpus(device, sysfs) if device.type == "cuda" else None
    online = online_cpus(sysfs)
    # Bound already (a subset of the machine), or a node spanning every CPU: nothing to do.
    if online is None or allowed != online or node is None or node >= online:
        node = None
    mine = (socket.gethostname(), node)
    binding = plan_binding(mine, gather(mine), rank, sysfs)
    if binding is None:
        return None
    bind_threads(binding.cpus)
    torch.set_num_threads(binding.threads)
    logger.debug(
        "rank %d bound to CPUs %s (%d cores of its GPU's node, shared by %d ranks)",
        rank,
        format_cpulist(binding.cpus),
        binding.threads,
        binding.ranks_on_node,
    )
    return binding


def online_cpus(sysfs: Path = SYSFS) -> frozenset[int] | None:
    """The machine's online logical CPUs; None if unknown."""
    try:
        return parse_cpulist((sysfs / "devices/system/cpu/online").read_text())
    except OSError:
        return None


def format_cpulist(cpus: frozenset[int]) -> str:
    """{0, 1, 2, 3, 8} -> ``"0-3,8"``."""
    parts, run = [], []
    for cpu in sorted(cpus):
        if run and cpu != run[-1] + 1:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(cpu)
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)
