"""The planned step, window by window: measured against the cost model's windows (dev tool).

python devtools/step_timeline.py WORKLOAD CAP [--warmup N] [--steps N] [--set KEY=VALUE ...]
    e.g. python devtools/step_timeline.py llama-1b-full 8GiB --set cpu_threads=8
python devtools/step_timeline.py WORKLOAD none --vanilla     # plain training, same hooks

After the warm-up (profiling steps, the switch to the searched plan, the calibration), each
timed step records CUDA events on the compute stream at every block's forward pre-hook (after
the runtime's own, so after its waits for the block's chunks), at the gradient of every block's
output (the block's backward starts) and around ``loss.backward()`` and ``optimizer.step()``,
with the host clock beside each. A forward window is the time from one block's pre-hook to the
next one's (the block's compute plus the wait for the next block's chunks), which is what
``cost_time.step_windows`` predicts as w_f[u]; a backward window from one block's output gradient to
the one before's (w_b[u]). The table shows, per unit: the profiled compute, the predicted window
and the measured one (median over the timed steps), and how far the host ran ahead of the GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from autooffload.plan.cost_time import predict_step_time, step_windows
from autooffload.plan.replan import with_running_split
from autooffload.runtime import runtime_of
from autooffload.setting_values import parse_size_or_fraction
from devtools._workload import capped_workload, plain_workload


class Recorder:
    """CUDA events and host times at named points of one step."""

    def __init__(self) -> None:
        self.points: list[tuple[str, torch.cuda.Event, float]] = []
        self.on = False

    def mark(self, name: str) -> None:
        if not self.on:
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.points.append((name, event, time.perf_counter()))

    def take(self) -> dict[str, tuple[float, float]]:
        """name -> (GPU ms, host ms) since the first point; the last of repeated names kept
        for backward points (a checkpointed block's recompute runs its forward hooks again)."""
        torch.cuda.synchronize()
        first_event, first_host = self.points[0][1], self.points[0][2]
        out: dict[str, tuple[float, float]] = {}
        for name, event, host in self.points:
            if name in out and name.startswith("fwd"):
                continue  # the recompute's pre-hook in the backward, not the forward's
            out[name] = (first_event.elapsed_time(event), (host - first_host) * 1e3)
        self.points = []
        return out


def block_modules(model: torch.nn.Module, vanilla: bool) -> list[torch.nn.Module]:
    """The blocks in execution order: the runtime's, or the largest ModuleList's (vanilla)."""
    if vanilla:
        lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
        return list(max(lists, key=len))
    runtime = runtime_of(model)
    groups = [g for g in runtime.groups if g.is_block]
    return [g.module for g in sorted(groups, key=lambda g: runtime.position(g.index))]


def install(blocks: list[torch.nn.Module], recorder: Recorder) -> int:
    """Hooks on every block; the number of blocks."""
    for i, module in enumerate(blocks):

        def pre(module: Any, args: Any, i: int = i) -> None:
            if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
                return
            recorder.mark(f"fwd{i}")

        def post(module: Any, args: Any, out: Any, i: int = i) -> None:
            if torch._C._current_graph_task_id() != -1:
                return
            first = out[0] if isinstance(out, tuple) else out
            if isinstance(first, torch.Tensor) and first.requires_grad:
                first.register_hook(lambda g, i=i: recorder.mark(f"bwd{i}"))

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
    return len(blocks)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workload")
    parser.add_argument("cap")
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--set", action="append", default=[], help="an autooffload setting")
    parser.add_argument("--vanilla", action="store_true", help="plain training, uncapped")
    args = parser.parse_args()
    if args.vanilla:
        model, optimizer, batch = plain_workload(args.workload)
    else:
        settings = dict(item.split("=", 1) for item in args.set)
        if args.cap != "none":
            # The bench's autooffload peer passes the cap as the budget too.
            settings.setdefault("budget", parse_size_or_fraction(args.cap, "cap"))
        model, optimizer, batch = capped_workload(args.workload, args.cap, **settings)
    recorder = Recorder()
    n_blocks = install(block_modules(model, args.vanilla), recorder)
    runs: list[dict[str, tuple[float, float]]] = []
    walls = []
    for index in range(args.warmup + args.steps):
        recorder.on = index >= args.warmup
        torch.cuda.synchronize()
        start = time.perf_counter()
        recorder.mark("start")
        loss = model(**batch).loss
        recorder.mark("fwd_end")
        loss.backward()
        recorder.mark("bwd_end")
        optimizer.step()
        optimizer.zero_grad()
        recorder.mark("opt_end")
        float(loss)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - start) * 1e3)
        if recorder.on:
            runs.append(recorder.take())

    if args.vanilla:
        print_measured(runs, n_blocks, walls[args.warmup :])
        return
    runtime = runtime_of(model)
    request = runtime.search_request
    plan = runtime.plan
    # As the calibration judges the running step: at the plan's GPU update split (on auto, a
    # calibrated CPU rate would re-derive another split than the one running).
    profile = with_running_split(request.profiles_by_chunk_size[plan.chunk_size], plan)
    predicted_s, breakdown, bottleneck = predict_step_time(profile, request.hw, plan.knobs)
    windows = step_windows(profile, request.hw, plan.knobs)
    print(plan.summary())
    print(f"hw: {request.hw}")

    def med(fn: Any) -> tuple[float, float]:
        gpu = statistics.median(fn(r, 0) for r in runs)
        host = statistics.median(fn(r, 1) for r in runs)
        return gpu, host

    def span(a: str, b: str) -> Any:
        return lambda r, k: r[b][k] - r[a][k]

    units = profile.units
    rows = []
    # Forward: pre = start -> fwd0; block i = fwd{i} -> fwd{i+1}; the last block and the post
    # part together = fwd{L-1} -> fwd_end.
    fwd_names = ["start"] + [f"fwd{i}" for i in range(n_blocks)] + ["fwd_end"]
    for u in range(n_blocks + 1):
        gpu, host = med(span(fwd_names[u], fwd_names[u + 1]))
        compute = units[u].fwd_s + (units[u + 1].fwd_s if u == n_blocks else 0.0)
        pred = windows.fwd[u] + (windows.fwd[u + 1] if u == n_blocks else 0.0)
        rows.append(("fwd", u, compute, pred, gpu, host))
    # Backward: post = fwd_end -> bwd{L-1} (loss backward and the head); block i = bwd{i} ->
    # bwd{i-1}; block 0 and the pre part together = bwd0 -> bwd_end.
    bwd_names = ["fwd_end"] + [f"bwd{i}" for i in reversed(range(n_blocks))] + ["bwd_end"]
    for k in range(n_blocks + 1):
        u = n_blocks + 1 - k
        gpu, host = med(span(bwd_names[k], bwd_names[k + 1]))
        compute = units[u].bwd_s + (units[0].bwd_s if u == 1 else 0.0)
        pred = windows.bwd[u] + (windows.bwd[0] if u == 1 else 0.0)
        rows.append(("bwd", u, compute, pred, gpu, host))
    print(f"{'':4}{'unit':>5}{'compute':>10}{'pred win':>10}{'meas GPU':>10}{'host':>10}  ms")
    for phase, u, compute, pred, gpu, host in rows:
        print(f"{phase:4}{u:5d}{compute * 1e3:10.2f}{pred * 1e3:10.2f}{gpu:10.2f}{host:10.2f}")
    totals = {
        "forward": med(span("start", "fwd_end")),
        "backward": med(span("fwd_end", "bwd_end")),
        "optimizer.step + zero_grad": med(span("bwd_end", "opt_end")),
        "start -> opt_end": med(span("start", "opt_end")),
    }
    print(
        f"predicted: step {predicted_s * 1e3:.1f} ms, t_fwd {windows.t_fwd * 1e3:.1f},"
        f" t_bwd {windows.t_bwd * 1e3:.1f}, gpu_optim {windows.gpu_optim_s * 1e3:.1f}"
        f" (in t_fwd), stalls { ({k: round(v * 1e3, 1) for k, v in windows.stalls.items()}) },"
        f" bottleneck {bottleneck}"
    )
    for name, (gpu, host) in totals.items():
        print(f"measured {name}: GPU {gpu:.1f} ms, host {host:.1f} ms")
    timed = walls[args.warmup :]
    print(f"measured wall per step (synchronised): {statistics.median(timed):.1f} ms {timed}")
    print(f"stats: {runtime.stats()}")
    print(f"breakdown: { {k: round(v, 4) for k, v in breakdown.items()} }")


def print_measured(runs: list[dict], n_blocks: int, walls: list[float]) -> None:
    """The measured windows alone (no plan to compare with)."""
    names = ["start"] + [f"fwd{i}" for i in range(n_blocks)] + ["fwd_end"]
    names += [f"bwd{i}" for i in reversed(range(n_blocks))] + ["bwd_end", "opt_end"]
    print(f"{'from':>8}{'to':>8}{'GPU':>10}{'host':>10}  ms (median)")
    for a, b in zip(names, names[1:]):
        gpu = statistics.median(r[b][0] - r[a][0] for r in runs)
        host = statistics.median(r[b][1] - r[a][1] for r in runs)
        print(f"{a:>8}{b:>8}{gpu:10.2f}{host:10.2f}")
    print(f"measured wall per step (synchronised): {statistics.median(walls):.1f} ms {walls}")


if __name__ == "__main__":
    main()
