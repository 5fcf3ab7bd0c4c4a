"""Each step's device memory peak from its first step on, and who holds the memory at the
highest one (dev tool).

Records the allocator's history from before the model is built (so the profiling steps, the
switch to the searched plan and its first steps are all in it), marks each step's start in the
trace, and prints per step: the peak allocated above the trace's start and where it was reached;
then, at the highest peak (or ``--at-step``'s), the live blocks grouped by the two innermost
autooffload / transformers / peft / torch frames that allocated them and by the step that
allocated them (a block from an earlier step still live is a leftover), largest first.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python devtools/step_peaks.py \\
        llama-8b-lora 16GiB --bs 1 --seq 32768 --no-gc --steps 4
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from _workload import (
    add_workload_arguments,
    record_allocations,
    where,
    workload_from_arguments,
)

import autooffload
from autooffload.runtime import runtime_of

GiB = 1 << 30
MARK_BYTES = 7_777_792  # a size no model allocates: one marker block at each step's start


def replay(
    events: list[dict],
) -> tuple[dict[int, tuple[int, str, int]], set[int], dict[int, tuple[int, int]]]:
    """Walk the trace: the blocks live at its end (address -> size, where allocated, the step
    that allocated it), those of them freed but waiting on a side stream, and per step the peak
    above the trace's start with its event index. A block counts until its free completes (one
    freed while a side stream still uses it, ``record_stream``, completes later), as the
    allocator's allocated counter has it."""
    live: dict[int, tuple[int, str, int]] = {}
    pending: set[int] = set()
    peaks: dict[int, tuple[int, int]] = {}
    current, step = 0, -1
    for index, event in enumerate(events):
        action, addr, size = event["action"], event.get("addr"), event.get("size", 0)
        if action == "alloc":
            if size == MARK_BYTES:
                step += 1
                continue
            live[addr] = (size, where(event.get("frames", [])), step)
            pending.discard(addr)
            current += size
            if step not in peaks or current > peaks[step][0]:
                peaks[step] = (current, index)
        elif action == "free_requested" and addr in live:
            pending.add(addr)
        elif action == "free_completed" and addr in live:
            current -= live.pop(addr)[0]
            pending.discard(addr)
    return live, pending, peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(parser)
    parser.add_argument("--at-step", type=int, help="report this step's peak (default: highest)")
    parser.add_argument("--no-history", action="store_true", help="per-step peaks only")
    args = parser.parse_args()

    if not args.no_history:
        record_allocations(3_000_000)
    model, optimizer, batch = workload_from_arguments(args)
    failure = None
    for step in range(args.steps):
        marker = torch.empty(MARK_BYTES, dtype=torch.uint8, device="cuda")
        del marker
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        try:
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        except torch.OutOfMemoryError as error:
            failure = f"OOM in step {step}: {str(error).splitlines()[0][:200]}"
            break
        torch.cuda.synchronize()
        plan = autooffload.last_plan()
        print(
            f"step {step} done in {time.perf_counter() - start:.1f} s: allocated"
            f" {torch.cuda.memory_allocated() / GiB:.3f} GiB, max allocated since the step's"
            f" start {torch.cuda.max_memory_allocated() / GiB:.3f} (reserved"
            f" {torch.cuda.max_memory_reserved() / GiB:.3f}; the runtime may reset these"
            f" within a step), plan {plan.source if plan else None}",
            flush=True,
        )
    if args.no_history:
        if failure:
            print(failure)
        return
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    if failure:
        print(failure)
    plan = autooffload.last_plan()
    if plan is not None:
        print(plan.summary())
        terms = {k: round(v / GiB, 3) for k, v in plan.breakdown.items() if k.startswith("mem")}
        print("predicted terms GiB:", terms)
        runtime = runtime_of(model) or runtime_of(next(model.parameters()))
        if runtime is not None and runtime.profile is not None:
            block = runtime.profile.blocks[-1]
            sizes = {
                k: round(v / GiB, 3)
                for k, v in vars(block).items()
                if "bytes" in k and isinstance(v, int)
            }
            print("last block as measured, GiB:", sizes)

    events = snapshot["device_traces"][0]
    _, _, peaks = replay(events)
    for s, (peak, index) in sorted(peaks.items()):
        label = "before step 0" if s < 0 else f"step {s}"
        print(f"{label}: peak {peak / GiB:.3f} GiB above the trace's start at event {index}")
    if not peaks:
        return
    chosen = args.at_step if args.at_step is not None else max(peaks, key=lambda s: peaks[s][0])
    target = peaks[chosen][1]
    live, pending, _ = replay(events[: target + 1])
    print(
        f"live at step {chosen}'s peak ({peaks[chosen][0] / GiB:.3f} GiB,"
        f" {where(events[target].get('frames', []), 3)}):"
    )
    groups: dict[tuple[str, int, bool], list[int]] = collections.defaultdict(lambda: [0, 0])
    for addr, (size, place, born) in live.items():
        key = (place, born, addr in pending)
        groups[key][0] += size
        groups[key][1] += 1
    print(f"  (freed, waiting on a side stream: {sum(live[a][0] for a in pending) / GiB:.3f} GiB)")
    for (place, born, waiting), (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[
        :30
    ]:
        state = "freed, waiting" if waiting else "live"
        print(
            f"  {size / GiB:7.3f} GiB {count:5d} blocks  from step {born:2d}  {state:14s} {place}"
        )


if __name__ == "__main__":
    main()
