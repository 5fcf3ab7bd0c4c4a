"""How much device memory a fixed plan needs, and what the caching allocator's retries cost.

Under a cap, ``max_memory_reserved`` reads as the cap whenever the allocator had to free its
cache (a retry) to serve an allocation, so a reserved peak at the cap says nothing about what
the plan needs. This pins one plan (every knob), warms it up under the starting cap, then
lowers ``set_per_process_memory_fraction`` step by step within the same process and, per cap,
runs a few steps and prints the median step time, the allocator retries, and the reserved and
allocated peaks, until a step runs out of memory. The OOM retry is off, so the plan never
changes under the sweep.

    python devtools/cap_need.py llama-8b-full \\
        '{"chunk_size": 436224000, "n_persist": 9, "n_buffer": 3, "n_swap": 0,
          "n_checkpoint": 30}' 24,23,22,21,20.5,20,19.5,19 [steps per cap] [--json out.json]
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

import autooffload
from autooffload import runtime as rt
from autooffload.bench.models import accepted_batch, build_model, make_batch
from autooffload.bench.workloads import get_workload

GiB = 1 << 30


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
    if out in args:
        args.remove(out)
    workload = get_workload(args[0])
    knobs = json.loads(args[1])
    caps = [float(c) * GiB for c in args[2].split(",")]
    steps = int(args[3]) if len(args) > 3 else 3
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, caps[0] / total), 0)
    autooffload.enable(
        budget=int(caps[0]), oom_retry=False, **{**workload.autooffload_defaults, **knobs}
    )
    model = build_model(workload).to("cuda")
    runtime = rt.runtime_of(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=workload.lr, fused=True)
    batch = {k: v.cuda() for k, v in accepted_batch(model, make_batch(workload)).items()}

    def step() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    for _ in range(6):
        step()
    print(runtime.plan.summary(), flush=True)
    breakdown = runtime.plan.breakdown
    print(
        f"predicted: allocated {breakdown['mem_allocated'] / GiB:.2f} GiB, pooled"
        f" {breakdown['mem_pooled'] / GiB:.2f}, fragmentation {breakdown['mem_fragmentation']:.3f},"
        f" peak {runtime.plan.predicted_peak_bytes / GiB:.2f}",
        flush=True,
    )
    rows = []
    for cap in caps:
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), 0)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        row = {"cap_gib": cap / GiB}
        try:
            times = [step() for _ in range(steps)]
        except torch.OutOfMemoryError as error:
            row["oom"] = str(error).splitlines()[0][:200]
            rows.append(row)
            print(f"cap {cap / GiB:.2f} GiB: out of memory ({row['oom']})", flush=True)
            break
        row.update(
            step_ms=1000 * statistics.median(times),
            retries_per_step=(torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries)
            / steps,
            max_reserved_gib=torch.cuda.max_memory_reserved() / GiB,
            max_allocated_gib=torch.cuda.max_memory_allocated() / GiB,
        )
        rows.append(row)
        print(
            f"cap {cap / GiB:.2f} GiB: step {row['step_ms']:.0f} ms,"
            f" {row['retries_per_step']:.1f} retries/step, reserved"
            f" {row['max_reserved_gib']:.2f}, allocated {row['max_allocated_gib']:.2f}",
            flush=True,
        )
    print("plan after the sweep:", runtime.plan.summary().splitlines()[1:3], flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(
                {"workload": args[0], "knobs": knobs, "plan_breakdown": breakdown, "rows": rows},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
