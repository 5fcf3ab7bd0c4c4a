"""Where a data-parallel step's time goes, rank by rank (dev tool).

torchrun --nproc-per-node 4 devtools/trace_dp.py WORKLOAD CAP [--warmup N] [--steps N]
    [--set KEY=VALUE ...] [--profile]
    e.g. torchrun --nproc-per-node 4 devtools/trace_dp.py llama-3b-full 24GiB --profile

Every rank attaches the bench workload's model under the cap, warms up (profiling, the switch
to the searched plan, the calibration), then times steps (each ended by a synchronisation and
a barrier) and reports, per rank: the step, the plan and its predicted step, the copy counters
over the timed steps (H2D copy seconds of the chunks it owns, gather seconds from a sharded
chunk's copy start to its broadcast's end, D2H, the host's stalls on the CPU update, the CPU
update's busy seconds), the hardware profile the plan used, its CPU binding. ``--profile`` adds
``torch.profiler`` over two more steps: per rank the GPU time per kernel family (copies,
NCCL, GEMMs, optimizer). Rank 0 prints the table; with ``$OUT`` set every rank writes
``trace_dp_rank<R>.json`` (and rank 0 its Chrome trace).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import autooffload
from autooffload.bench.models import accepted_batch, build_model, make_batch
from autooffload.bench.workloads import get_workload
from autooffload.runtime import runtime_of
from autooffload.setting_values import parse_size_or_fraction
from devtools._kernels import family

STATS = ("h2d_s", "gather_s", "d2h_s", "stall_s", "cpu_optim_s", "h2d_bytes", "d2h_bytes")


def kernel_time(prof: Any, steps: int) -> dict[str, float]:
    """ms per step of GPU time per kernel family."""
    times: dict[str, float] = collections.Counter()
    for event in prof.key_averages():
        if event.self_device_time_total > 0:
            times[family(event.key)] += event.self_device_time_total / 1e3 / steps
    return {k: round(v, 1) for k, v in sorted(times.items(), key=lambda kv: -kv[1])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workload")
    parser.add_argument("cap")
    parser.add_argument("--warmup", type=int, default=14)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--set", action="append", default=[], help="an autooffload setting")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    cap = parse_size_or_fraction(args.cap, "cap")
    total = torch.cuda.get_device_properties(local).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), local)
    workload = get_workload(args.workload)
    settings = dict(item.split("=", 1) for item in args.set)
    autooffload.enable(**{**workload.autooffload_defaults, "budget": cap, **settings})
    model = build_model(workload).to("cuda")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    batch = {k: v.cuda() for k, v in accepted_batch(model, make_batch(workload)).items()}
    runtime = runtime_of(model)

    def step() -> None:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    before = runtime.stats()
    walls = []
    for _ in range(args.steps):
        started = time.perf_counter()
        step()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - started) * 1e3)
        dist.barrier()
    after = runtime.stats()
    per_step = {k: (after.get(k, 0) - before.get(k, 0)) / args.steps for k in STATS}
    plan = runtime.plan
    request = getattr(runtime, "search_request", None)
    hw = request.hw if request is not None else None
    report: dict[str, Any] = {
        "rank": rank,
        "world": world,
        "step_ms": round(statistics.median(walls), 1),
        "steps_ms": [round(w, 1) for w in walls],
        "predicted_ms": round(plan.predicted_step_s * 1e3, 1) if plan.predicted_step_s else None,
        "plan": plan.summary(),
        "per_step_ms": {k: round(v * 1e3, 1) for k, v in per_step.items() if k.endswith("_s")},
        "per_step_gb": {k: round(v / 1e9, 2) for k, v in per_step.items() if k.endswith("bytes")},
        "hw": None
        if hw is None
        else {
            "h2d_gbps": round(hw.h2d_bps / 1e9, 1),
            "d2h_gbps": round(hw.d2h_bps / 1e9, 1),
            "cpu_optim_gparams": round(hw.cpu_optim_params_per_s / 1e9, 2),
        },
        "cpus": len(os.sched_getaffinity(0)),
        "threads": torch.get_num_threads(),
        "peak_gib": round(torch.cuda.max_memory_reserved() / (1 << 30), 2),
    }
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        report["kernel_ms_per_step"] = kernel_time(prof, 2)
        if rank == 0 and os.environ.get("OUT"):
            prof.export_chrome_trace(os.path.join(os.environ["OUT"], "trace_dp_rank0.trace.json"))
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, report)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"trace_dp_rank{rank}.json"), "w") as file:
            json.dump(report, file, indent=1)
    if rank == 0:
        print(report["plan"], flush=True)
        for r in everyone:
            print(
                f"rank {r['rank']}: step {r['step_ms']} ms (pred {r['predicted_ms']}),"
                f" per step ms {r['per_step_ms']}, GB {r['per_step_gb']}, hw {r['hw']},"
                f" cpus {r['cpus']} threads {r['threads']}, peak {r['peak_gib']} GiB"
                + (f"\n   kernels {r['kernel_ms_per_step']}" if "kernel_ms_per_step" in r else ""),
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
