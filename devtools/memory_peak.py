"""Where a planned step's device memory peak goes: record one step's allocations on the GPU
and list what is live at the peak, grouped by the innermost frame of autooffload or
transformers that allocated it, beside the plan's predicted memory terms.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python devtools/memory_peak.py \\
        llama-3.6b-full 16 '{"n_persist": 17, "n_swap": 16, "n_checkpoint": 12}' [steps]
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import torch

import autooffload
from autooffload import runtime as rt
from autooffload.bench.models import build_model, make_batch
from autooffload.bench.workloads import get_workload

GiB = 1 << 30


def where(frames: list[dict]) -> str:
    for frame in frames:
        name = frame.get("filename", "")
        if "/autooffload/" in name or "/transformers/" in name:
            short = "/".join(name.split("/")[-2:])
            return f"{short}:{frame.get('line')} {frame.get('name')}"
    return frames[0].get("name", "?") if frames else "?"


def main() -> None:
    workload = get_workload(sys.argv[1])
    cap = float(sys.argv[2]) * GiB
    overrides = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 8
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), 0)
    autooffload.enable(budget=int(cap), **{**workload.autooffload_defaults, **overrides})
    model = build_model(workload).to("cuda")
    runtime = rt.runtime_of(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=workload.lr, fused=True)
    batch = {k: v.cuda() for k, v in make_batch(workload).items()}

    def step() -> None:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(steps - 1):
        step()
    torch.cuda.synchronize()
    print(runtime.plan.summary())
    terms = {k: round(v / GiB, 3) for k, v in runtime.plan.breakdown.items() if k.startswith("mem")}
    print("predicted terms GiB:", terms)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    step()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    print(
        f"measured: start {base / GiB:.3f} GiB, peak allocated"
        f" {torch.cuda.max_memory_allocated() / GiB:.3f}, reserved"
        f" {torch.cuda.max_memory_reserved() / GiB:.3f}"
    )
    live: dict[int, tuple[int, str]] = {}
    current, best, best_live, best_index = 0, -1, {}, 0
    events = snapshot["device_traces"][0]
    for index, event in enumerate(events):
        action, addr, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            live[addr] = (size, where(event.get("frames", [])))
            current += size
            if current > best:
                best, best_live, best_index = current, dict(live), index
        elif action == "free_requested" and addr in live:
            current -= live.pop(addr)[0]
    print(
        f"{len(events)} events; peak above the step's start: {best / GiB:.3f} GiB at event"
        f" {best_index} ({where(events[best_index].get('frames', []))})"
    )
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, place in best_live.values():
        groups[place][0] += size
        groups[place][1] += 1
    for place, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:25]:
        print(f"  {size / GiB:7.3f} GiB  {count:5d}  {place}")


if __name__ == "__main__":
    main()
