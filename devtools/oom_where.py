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
import json

import torch
from _workload import capped_workload

import autooffload
from autooffload.setting_values import parse_size_or_fraction

GiB = 1 << 30
INTERESTING = ("autooffload/", "transformers/", "peft/", "torch/utils/checkpoint", "torch/optim")


def where(frames: list[dict], depth: int) -> str:
    out = []
    for frame in frames:
        path = frame.get("filename", "")
        if any(key in path for key in INTERESTING):
            short = "/".join(path.split("/")[-2:])
            out.append(f"{short}:{frame.get('line')} {frame.get('name')}")
            if len(out) == depth:
                break
    return " <- ".join(out) if out else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload")
    parser.add_argument("cap")
    parser.add_argument("--bs", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--no-gc", action="store_true")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--depth", type=int, default=3, help="frames per allocation site")
    parser.add_argument("--settings", default="{}", help="JSON of extra enable() settings")
    args = parser.parse_args()
    settings = {"oom_retry": False, **json.loads(args.settings)}
    # Allocations only, Python frames (as devtools/step_peaks.py: recording frees breaks the
    # checkpoint recompute in torch 2.11).
    torch.cuda.memory._record_memory_history(
        max_entries=1_000_000, context="alloc", stacks="python"
    )
    model, optimizer, batch = capped_workload(
        args.workload,
        args.cap,
        bs=args.bs,
        seq=args.seq,
        gc=False if args.no_gc else None,
        budget=parse_size_or_fraction(args.cap, "cap"),
        **settings,
    )
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
