"""One benchmark run in a fresh process: apply the cap, set up one peer, time its steps, write JSON.

Run as ``python -m autooffload.bench._worker SPEC.json``; the spec names the workload, peer,
options, device, cap, steps and the path of the result file. The result is always written, with
status "ok", "OOM", "skipped" or "error" (a harness crash is never the outcome of a peer failure).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from autooffload.atomic import write_text_atomic

GiB = 1 << 30
TRACEBACK_LINES = 15


def _is_oom(exc: BaseException) -> bool:
    # By name, so that a failed ``import torch`` cannot break the error path.
    if type(exc).__name__ in ("OutOfMemoryError", "PlanError"):  # PlanError: nothing fits
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def _apply_cap(device: str, cap_bytes: int | None) -> dict[str, Any]:
    """Limit this process's CUDA caching allocator to ``cap_bytes`` before anything is allocated."""
    import torch

    if device != "cuda":
        return {}
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    total = torch.cuda.get_device_properties(local).total_memory
    info: dict[str, Any] = {"device_total_gib": total / GiB}
    if cap_bytes is not None:
        fraction = min(1.0, cap_bytes / total)
        torch.cuda.set_per_process_memory_fraction(fraction, local)
        info["cap_fraction"] = fraction
    return info


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    versions: dict[str, str | None] = {"python": platform.python_version()}
    names = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "deepspeed")
    for name in (*names, "autooffload"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            module = sys.modules.get(name)
            versions[name] = getattr(module, "__version__", None) if module else None
    return versions


def _cuda_peaks() -> tuple[float, float]:
    """(max allocated, max reserved) GiB of this process's allocator since its last reset."""
    import torch

    return torch.cuda.max_memory_allocated() / GiB, torch.cuda.max_memory_reserved() / GiB


def _memory(device: str, before_timing: tuple[float, float] | None = None) -> dict[str, Any]:
    """Host RSS and device peaks of the whole run (``before_timing``: the peaks up to the reset
    at the first timed step)."""
    out: dict[str, Any] = {
        "host_rss_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB
    }
    if device == "cuda":
        import torch

        if torch.cuda.is_initialized():
            allocated, reserved = _cuda_peaks()
            earlier = before_timing or (0.0, 0.0)
            out["peak_allocated_gib"] = max(allocated, earlier[0])
            out["peak_reserved_gib"] = max(reserved, earlier[1])
            out["device_name"] = torch.cuda.get_device_name()
    else:
        out["device_name"] = f"cpu ({platform.processor() or platform.machine()})"
    return out


# Warm-up steps the bench adds, at most, while a peer is not settled (``Trainee.settled``): an
# autooffload plan that re-plans at every check (three in a row at most) settles within 15.
EXTRA_WARMUP_LIMIT = 15


def _train(
    trainee: Any, spec: dict[str, Any], workload: Any, result: dict[str, Any]
) -> dict[str, Any]:
    """Warm-up then timed steps on the same batch; each step synchronised and timed.

    On CUDA the allocator's peak counters are reset at the first timed step (the peaks before
    go to ``result["_peaks_before_timing"]``), so the timed steps' own peaks are known too.
    """
    import torch

    from autooffload.bench.models import accepted_batch, make_batch

    device = spec["device"]
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    batch_cpu = accepted_batch(trainee.model, make_batch(workload, seed=spec["seed"]))
    warmup, steps = spec["warmup"], spec["steps"]
    warmup_limit = warmup + EXTRA_WARMUP_LIMIT
    step_s: list[float] = []
    losses: list[float] = []
    # The allocator's retries per step (it freed its cache and synchronised to fit a request).
    retries = (
        (lambda: torch.cuda.memory_stats().get("num_alloc_retries", 0)) if cuda else (lambda: 0)
    )
    step_retries: list[int] = []
    index = 0
    while index < warmup + steps:
        result["_step_index"] = index  # where a failure happened (0-based, warm-up included)
        if index == warmup and warmup < warmup_limit and not trainee.settled():
            warmup += 1  # not in its steady state yet (autooffload re-planned): warm up on
        if index == warmup:
            trainee.on_timing_start()
            if cuda:
                sync()
                result["_peaks_before_timing"] = _cuda_peaks()
                torch.cuda.reset_peak_memory_stats()
        sync()
        before = retries()
        start = time.perf_counter()
        batch = {k: v.to(device) for k, v in batch_cpu.items()}
        loss = trainee.step(batch)
        sync()
        step_s.append(time.perf_counter() - start)
        trainee.on_step_end()
        step_retries.append(retries() - before)
        losses.append(float(loss))
        index += 1
    timed = step_s[warmup:]
    median = statistics.median(timed)
    world = _world_size()
    if cuda:
        # Reserved includes what the warm-up left cached: the memory held while the plan runs.
        result["peak_timed_allocated_gib"], result["peak_timed_reserved_gib"] = _cuda_peaks()
    return {
        "step_s": step_s,
        "step_alloc_retries": step_retries,
        "losses": losses,
        "step_s_median": median,
        # The warm-up steps run: the requested ones, and more while the peer was not settled.
        "warmup": warmup,
        # Every rank trains its own batch of the workload's shape: global throughput.
        "tokens_per_s": world * workload.tokens_per_step / median,
        "tokens_per_s_per_gpu": workload.tokens_per_step / median,
        "loss_first": losses[0],
        # After as many steps as every peer runs (the warm-up asked for, then the timed steps),
        # so that a peer whose warm-up went on is compared at the same step.
        "loss_final": losses[spec["warmup"] + steps - 1],
        "loss_last": losses[-1],
    }


def _plan_summary() -> str | None:
    """The autooffload plan in force, if autooffload ran in this worker."""
    module = sys.modules.get("autooffload")
    plan = getattr(module, "last_plan", lambda: None)() if module is not None else None
    return plan.summary() if plan is not None else None


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _init_distributed(device: str) -> None:
    """Under torchrun (several ranks): the default process group, before any peer is built."""
    import torch.distributed as dist

    if _world_size() > 1 and not dist.is_initialized():
        # gloo beside NCCL: FSDP2's CPU-offloaded DTensors reduce host tensors.
        dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo")


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one peer on one workload as ``spec`` says; the result dict (never raises)."""
    started = time.perf_counter()
    result: dict[str, Any] = {"status": "error", "reason": None}
    device = spec["device"]
    trainee = None
    try:
        import torch

        result["cap_info"] = _apply_cap(device, spec.get("cap_bytes"))
        _init_distributed(device)
        torch.manual_seed(spec["seed"])

        from autooffload.bench.flops import mfu
        from autooffload.bench.peers import PeerContext, get_peer
        from autooffload.bench.workloads import get_workload

        workload = get_workload(spec["workload"], **spec.get("overrides", {}))
        ctx = PeerContext(
            workload, device, spec.get("cap_bytes"), spec["seed"], spec.get("options", {})
        )
        build_start = time.perf_counter()
        trainee = get_peer(spec["peer"]).setup(ctx)
        trainee.accum = workload.accum
        result["setup_s"] = time.perf_counter() - build_start
        if device == "cuda":
            result["peak_setup_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB
        result.update(_train(trainee, spec, workload, result))
        # Model FLOPs utilisation against the GPU's peak (none on the CPU or an unknown GPU).
        gpu_name = torch.cuda.get_device_name() if device == "cuda" else None
        result.update(mfu(workload, result["tokens_per_s_per_gpu"], gpu_name))
        result.update(trainee.report(spec["steps"]))
        result["status"] = "ok"
    except BaseException as exc:  # every failure becomes a status, never a crash of the harness
        from autooffload.bench.peers import PeerUnavailable

        first_line = (str(exc).strip().splitlines() or [""])[0]
        result["message"] = f"{type(exc).__name__}: {first_line}"
        if isinstance(exc, PeerUnavailable):
            result.update(status="skipped", reason=str(exc))
        elif _is_oom(exc):
            message = str(exc).strip().splitlines()
            result.update(
                status="OOM", reason=f"{type(exc).__name__}: {message[0] if message else ''}"
            )
            # Where: the step, the innermost frames, and the plan running then.
            result["failed_step"] = result.get("_step_index")
            result["traceback_tail"] = traceback.format_exc().strip().splitlines()[-12:]
            result["plan_at_failure"] = _plan_summary()
            if trainee is not None:
                result.update(trainee.failure_report())
        else:
            lines = traceback.format_exc().strip().splitlines()
            result.update(status="error", reason="\n".join(lines[-TRACEBACK_LINES:]))
        if isinstance(exc, KeyboardInterrupt):
            result["reason"] = "interrupted"
    finally:
        if trainee is not None:
            try:
                trainee.close()
            except Exception:
                pass
        result.pop("_step_index", None)
        result.update(_memory(device, result.pop("_peaks_before_timing", None)))
        result["versions"] = _versions()
        result["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY")
        result["wall_s"] = time.perf_counter() - started
        result["date"] = dt.datetime.now().isoformat(timespec="seconds")
    return result


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    result = run(spec)
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        # The host holds every rank: the runner adds this rank's peak to rank 0's.
        rss = {"host_rss_peak_gib": result.get("host_rss_peak_gib")}
        write_text_atomic(Path(f"{spec['result_path']}.rank{rank}"), json.dumps(rss))
        return 0
    path = Path(spec["result_path"])
    write_text_atomic(path, json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
