"""Reserved device memory per allocator pool (stream) of an attached bench workload (dev tool).

The caching allocator keeps one pool per stream; the cost model predicts the chunk buffers'
pool (the H2D stream) and the compute stream's pool apart (``docs/planner.md``, "Two pools").
This runs a workload under a real cap and, after each step, prints each stream's reserved and
allocated bytes from the allocator snapshot next to the plan's predicted pool peaks.

python devtools/pool_reserved.py qwen2vl-7b-lora 16GiB [steps]
"""

import collections
import sys

import torch
from _workload import capped_workload

from autooffload import runtime as rt

GiB = 1 << 30
name, cap_text = sys.argv[1], sys.argv[2]
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 7
model, optimizer, batch = capped_workload(name, cap_text)
runtime = rt.runtime_of(model)


def stream_name(stream: int) -> str:
    if runtime is None:
        return str(stream)
    manager = runtime.manager
    known = {manager.h2d_stream.cuda_stream: "h2d", manager.grads.d2h_stream.cuda_stream: "d2h"}
    swapper = runtime.activations.swapper
    if swapper is not None and swapper.h2d_stream is not None:
        known[swapper.h2d_stream.cuda_stream] = "swap-h2d"
        known[swapper.d2h_stream.cuda_stream] = "swap-d2h"
    return known.get(stream, "compute" if stream == 0 else f"stream {stream:#x}")


for step in range(steps):
    model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    torch.cuda.synchronize()
    pools: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for segment in torch.cuda.memory_snapshot():
        pool = pools[stream_name(segment["stream"])]
        pool[0] += segment["total_size"]
        pool[1] += segment["allocated_size"]
        pool[2] += 1
    plan = runtime.plan if runtime is not None else None
    memory = plan.breakdown if plan is not None else {}
    reserved, max_reserved = torch.cuda.memory_reserved(), torch.cuda.max_memory_reserved()
    print(
        f"step {step} ({plan.source if plan else '-'}): reserved"
        f" {reserved / GiB:.2f} GiB (max {max_reserved / GiB:.2f}),"
        f" max allocated {torch.cuda.max_memory_allocated() / GiB:.2f};"
        f" predicted peak {(plan.predicted_peak_bytes or 0) / GiB:.2f},"
        f" chunk pool {memory.get('mem_buffers_max', 0) / GiB:.2f},"
        f" allocated {memory.get('mem_allocated', 0) / GiB:.2f},"
        f" pooled {memory.get('mem_pooled', 0) / GiB:.2f}"
    )
    for stream, (reserved, allocated, count) in sorted(pools.items()):
        print(
            f"    {stream}: reserved {reserved / GiB:.2f} GiB in {count} segments,"
            f" allocated now {allocated / GiB:.2f}"
        )
if runtime is not None:
    print(runtime.plan.summary())
    sizes = collections.Counter(round(c.nbytes / (1 << 20)) for c in runtime.layout.chunks)
    print("chunk sizes (MiB: count):", dict(sizes))
