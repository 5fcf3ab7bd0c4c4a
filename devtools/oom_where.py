"""Who holds the device memory when an attached bench workload runs out of it (dev tool).

Runs a ``python -m autooffload.bench`` workload under a real cap with the allocator's history
recorded; at the OOM it prints the live blocks grouped by the innermost autooffload /
transformers / peft frame that allocated them, largest total first.

python devtools/oom_where.py qwen2vl-7b-lora 16GiB [steps]
"""

import collections
import sys

import torch
from _workload import capped_workload

import autooffload
from autooffload.setting_values import parse_size_or_fraction

GiB = 1 << 30
name, cap_text = sys.argv[1], sys.argv[2]
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 4
torch.cuda.memory._record_memory_history(max_entries=200_000)
model, optimizer, batch = capped_workload(
    name, cap_text, budget=parse_size_or_fraction(cap_text, "cap")
)
INTERESTING = ("autooffload", "transformers", "peft", "torch/utils/checkpoint", "torch/optim")


def where(frames: list[dict]) -> str:
    for frame in frames:
        path = frame.get("filename", "")
        if any(key in path for key in INTERESTING):
            return f"{path.split('site-packages/')[-1]}:{frame.get('line')} {frame.get('name')}"
    return "?"


try:
    for step in range(steps):
        phase = "forward"
        loss = model(**batch).loss
        phase = "backward"
        loss.backward()
        phase = "step"
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step} ok, max allocated {torch.cuda.max_memory_allocated() / GiB:.2f} GiB")
except torch.OutOfMemoryError as error:
    print(f"OOM in step {step} ({phase}): {str(error).splitlines()[0][:160]}")
    snapshot = torch.cuda.memory._snapshot()
    totals: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                continue
            key = where(block.get("frames", []))
            totals[key][0] += block["size"]
            totals[key][1] += 1
    print(f"plan: {autooffload.last_plan().summary() if autooffload.last_plan() else None}")
    for key, (size, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:18]:
        print(f"{size / GiB:7.2f} GiB in {count:5d} blocks  {key}")
