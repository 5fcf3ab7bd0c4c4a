"""Host <-> GPU copy bandwidth per rank: one rank at a time, then all at once (dev tool).

torchrun --nproc-per-node 4 devtools/host_links.py [--gib 1] [--numa local,remote,none]

For each placement of the pinned host buffer (``local``: allocated while the process is bound
to its GPU's NUMA node; ``remote``: bound to another node; ``none``: as the process starts),
times H2D and D2H copies of one rank alone (the others wait) and of every rank at once, and
prints per rank GB/s. Rank 0 writes the table as JSON to ``$OUT/host_links.json`` if set.
"""

from __future__ import annotations

import argparse
import json
import os
import socket

import torch
import torch.distributed as dist

from autooffload.runtime.parallel.affinity import (
    SYSFS,
    bind_threads,
    format_cpulist,
    gpu_local_cpus,
    online_cpus,
)

GiB = 1 << 30


def timed_copy(dst: torch.Tensor, src: torch.Tensor, repeats: int) -> float:
    """Seconds per copy, CUDA events around ``repeats`` copies on a side stream."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(repeats):
            dst.copy_(src, non_blocking=True)
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def barrier() -> None:
    flag = torch.zeros(1, device="cuda")
    dist.all_reduce(flag)
    flag.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--numa", default="local,remote,none")
    args = parser.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local)
    start_cpus = frozenset(os.sched_getaffinity(0))
    node = gpu_local_cpus(device)
    online = online_cpus(SYSFS) or start_cpus
    other = (online - node) if node else frozenset()
    nbytes = int(args.gib * GiB)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rows = []
    for placement in args.numa.split(","):
        cpus = {"local": node, "remote": other, "none": start_cpus}[placement]
        if not cpus:
            continue
        bind_threads(cpus)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        host.fill_(1)
        result = {"placement": placement, "cpus": format_cpulist(cpus)}
        for direction, (dst, src) in (("h2d", (gpu, host)), ("d2h", (host, gpu))):
            alone = 0.0
            for turn in range(world):
                barrier()
                if turn == rank:
                    alone = nbytes / timed_copy(dst, src, args.repeats) / 1e9
            barrier()
            together = nbytes / timed_copy(dst, src, args.repeats) / 1e9
            result[f"{direction}_alone_gbps"] = round(alone, 2)
            result[f"{direction}_together_gbps"] = round(together, 2)
        rows.append(result)
        del host
        bind_threads(start_cpus)
    everyone: list = [None] * world
    mine = {
        "rank": rank,
        "host": socket.gethostname(),
        "gpu_node_cpus": format_cpulist(node or frozenset()),
        "rows": rows,
    }
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        for report in everyone:
            for row in report["rows"]:
                print(
                    f"rank {report['rank']} {row['placement']:>6} (cpus {row['cpus']}):"
                    f" H2D {row['h2d_alone_gbps']:6.1f} alone {row['h2d_together_gbps']:6.1f}"
                    f" together | D2H {row['d2h_alone_gbps']:6.1f} alone"
                    f" {row['d2h_together_gbps']:6.1f} together GB/s",
                    flush=True,
                )
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "host_links.json"), "w") as file:
                json.dump(everyone, file, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
