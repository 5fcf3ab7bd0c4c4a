"""Who holds the device memory when an attached bench workload runs out of it (dev tool).

Runs a ``python -m autooffload.bench`` workload under a real cap with the allocator's history
recorded and the OOM retry off (the first OOM is the one reported); at the OOM it prints the
live blocks grouped by the innermost autooffload / transformers / peft / torch frames that
allocated them, largest total first.

    python devtools/oom_where.py qwen2vl-7b-lora 16GiB
    python devtools/oom_where.py llama-8b-lora 16GiB --bs 1 --seq 98304 --no-gc \\
        --settings '{"saved_upcasts": false}'
"""

from __future__ import annotations

import argparse
import collections

import torch
from _workload import (
    add_workload_arguments,
    record_allocations,
    where,
    workload_from_arguments,
)

import autooffload

GiB = 1 << 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser)
    parser.add_argument("--depth", type=int, default=3, help="frames per allocation site")
    args = parser.parse_args()
    record_allocations(1_000_000)
    model, optimizer, batch = workload_from_arguments(args, oom_retry=False)
    step, phase = 0, "forward"
    try:
        for step in range(args.steps):
            phase = "forward"
            loss = model(**batch).loss
            phase = "backward"
            loss.backward()
            phase = "step"
            optimizer.step()
            optimizer.zero_grad()
            peak = torch.cuda.max_memory_allocated() / GiB
            print(f"step {step} ok, max allocated {peak:.2f} GiB", flush=True)
        return
    except torch.OutOfMemoryError as error:
        print(f"OOM in step {step} ({phase}): {str(error).splitlines()[0][:200]}")
        # Inside the handler: the traceback's frames still hold what the failed pass made.
        snapshot = torch.cuda.memory._snapshot()
    totals: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                continue
            key = where(block.get("frames", []), args.depth)
            totals[key][0] += block["size"]
            totals[key][1] += 1
    plan = autooffload.last_plan()
    print(f"plan: {plan.summary() if plan else None}")
    for key, (size, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:24]:
        print(f"{size / GiB:7.2f} GiB in {count:5d} blocks  {key}")


if __name__ == "__main__":
    main()
