"""Plan the runs (workloads x caps x peers x repeats, peers alternated) and run each in a worker."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from autooffload.atomic import write_text_atomic
from autooffload.bench.cli_values import cap_label, parse_options, parse_size
from autooffload.bench.deepspeed_configs import DEVICE_OOM, FAILED, FITS, HOST_OOM, HostNeed
from autooffload.bench.peers import get_peer
from autooffload.bench.workloads import (
    UnknownNameError,
    Workload,
    get_workload,
    workload_overrides,
    workload_to_dict,
)
from autooffload.runtime.chunks.host import host_memory

GiB = 1 << 30
HOST_MEMORY_PREFIX = "host memory:"
REPO_ROOT = Path(__file__).resolve().parents[2]
LOG_TAIL_LINES = 15


@dataclass(frozen=True)
class PeerSpec:
    """A peer with its options; ``label`` names it in tables (``autooffload[n_persist=0]``)."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    cap: str | None = None
    """The peer's own cap (``hf_gc[cap=78GiB]``), in place of ``--cap``: one run per repeat."""

    @property
    def label(self) -> str:
        shown = {**self.options, **({"cap": self.cap} if self.cap is not None else {})}
        if not shown:
            return self.name
        inner = ",".join(f"{k}={v}" for k, v in shown.items())
        return f"{self.name}[{inner}]"


def parse_peers(text: str, autooffload_opts: dict[str, Any] | None = None) -> list[PeerSpec]:
    """``vanilla,autooffload[n_persist=0,n_buffer=4]`` -> peer specs (names validated)."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    specs = []
    for part in (p.strip() for p in parts):
        if not part:
            continue
        match = re.fullmatch(r"([A-Za-z0-9_]+)(?:\[(.*)\])?", part)
        if not match:
            raise UnknownNameError(f"cannot parse peer {part!r}; expected NAME or NAME[k=v,...]")
        name = match.group(1)
        peer = get_peer(name)
        options: dict[str, Any] = {}
        if peer.autooffload_settings:
            options.update(autooffload_opts or {})
        given = [o for o in (match.group(2) or "").split(",") if o.strip()]
        # Any peer takes its own cap (``hf_gc[cap=78GiB]``): the runner's, not the peer's.
        caps = [o.split("=", 1)[1].strip() for o in given if o.split("=", 1)[0].strip() == "cap"]
        given = [o for o in given if o.split("=", 1)[0].strip() != "cap"]
        if caps:
            try:
                parse_size(caps[-1])
            except ValueError as error:
                raise UnknownNameError(f"peer {part!r}: cap: {error}") from None
        if given:
            if not peer.takes_options:
                raise UnknownNameError(f"peer {name!r} takes no options (got {part!r})")
            options.update(parse_options(given))
        peer.check_options(options)
        specs.append(PeerSpec(name, options, caps[-1] if caps else None))
    if not specs:
        raise UnknownNameError("no peers given")
    return specs


@dataclass(frozen=True)
class RunSpec:
    """One run: a peer on a workload under a cap; ``repeat`` counts from 0. ``sweep`` names the
    peer whose sweep this configuration belongs to (``PeerDef.sweep``). ``seq_sweep``: the run is
    one length of a ``--seq`` sweep (the workload holds the length; ``describe`` names it)."""

    workload: Workload
    peer: PeerSpec
    cap: int | None
    repeat: int
    nproc: int = 1
    sweep: str | None = None
    seq_sweep: bool = False

    @property
    def label(self) -> str:
        """The peer's label, with the GPU count when several (``autooffload x2``)."""
        return self.peer.label + (f" x{self.nproc}" if self.nproc > 1 else "")

    def describe(self) -> str:
        cap = cap_label(self.cap)
        seq = f" | seq {self.workload.seq}" if self.seq_sweep else ""
        return f"{self.workload.name}{seq} | cap {cap} | {self.label} | rep {self.repeat}"


def plan_runs(
    workloads: list[Workload],
    caps: list[int | None],
    peers: list[PeerSpec],
    repeat: int,
    vanilla_caps: list[int | None] | None = None,
    nprocs: list[int] | None = None,
    seqs: list[int] | None = None,
) -> list[RunSpec]:
    """The runs in execution order: per workload, per repeat, per sequence length, per GPU
    count, per cap, every peer (A B A B ...); a peer with a sweep and no options runs as each of
    its configurations in turn.

    ``vanilla_caps`` (when given) replaces ``caps`` for the vanilla peer, e.g. ``[None]`` runs the
    reference once uncapped per repeat instead of once per cap. ``nprocs`` lists the process
    (GPU) counts, each run data-parallel over that many ranks (default ``[1]``). ``seqs`` lists
    the sequence lengths, each its own set of runs (default: the workload's own length; with
    several, each run is marked ``seq_sweep``).
    """
    runs = []
    swept = len(seqs or []) > 1
    for base in workloads:
        for rep in range(repeat):
            for workload in [replace(base, seq=seq) for seq in seqs] if seqs else [base]:
                for nproc in nprocs or [1]:
                    runs += _peer_runs(workload, caps, peers, rep, nproc, vanilla_caps, swept)
    return runs


def _peer_runs(
    workload: Workload,
    caps: list[int | None],
    peers: list[PeerSpec],
    rep: int,
    nproc: int,
    vanilla_caps: list[int | None] | None,
    seq_sweep: bool,
) -> list[RunSpec]:
    """One workload's runs of one repeat on ``nproc`` GPUs: per cap, every peer (``plan_runs``)."""
    runs = []
    done_vanilla: set[int | None] = set()
    done_own: set[str] = set()
    for cap in caps:
        for peer in peers:
            if peer.cap is not None:
                if peer.label not in done_own:
                    done_own.add(peer.label)
                    own = parse_size(peer.cap)
                    runs += [
                        RunSpec(workload, spec, own, rep, nproc, sweep, seq_sweep)
                        for spec, sweep in _configurations(peer, workload, own)
                    ]
                continue
            if peer.name == "vanilla" and vanilla_caps is not None:
                for vcap in vanilla_caps:
                    if vcap not in done_vanilla:
                        done_vanilla.add(vcap)
                        runs.append(RunSpec(workload, peer, vcap, rep, nproc, None, seq_sweep))
                continue
            runs += [
                RunSpec(workload, spec, cap, rep, nproc, sweep, seq_sweep)
                for spec, sweep in _configurations(peer, workload, cap)
            ]
    return runs


def _configurations(
    peer: PeerSpec, workload: Workload, cap: int | None
) -> list[tuple[PeerSpec, str | None]]:
    """The peer itself, or each configuration of its sweep when it has one and no options."""
    sweep = get_peer(peer.name).sweep
    if sweep is None or peer.options:
        return [(peer, None)]
    candidates = sweep.candidates(workload, cap)
    return [(PeerSpec(peer.name, dict(options), peer.cap), peer.name) for options in candidates]


@dataclass
class CommonSettings:
    """What every run shares: device, steps, seed, timeout, where worker logs go, the
    ``time.monotonic()`` after which no run starts (``deadline``) and the one at which a run
    still going is killed (``end``; None: no limit), and the host memory a run's estimated need
    is checked against (``host_memory_bytes``; None: what the host has available before each
    run; ``check_host_memory=False``: no check)."""

    device: str
    steps: int
    warmup: int
    seed: int = 0
    timeout_s: float = 1800.0
    log_dir: Path | None = None
    verbose: bool = False
    deadline: float | None = None
    end: float | None = None
    host_memory_bytes: int | None = None
    check_host_memory: bool = True


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def _record(run: RunSpec, common: CommonSettings, index: int) -> dict[str, Any]:
    """The fields every result of ``run`` has, whatever its outcome."""
    return {
        "workload": run.workload.name,
        **{k: v for k, v in workload_to_dict(run.workload).items() if k != "name"},
        "peer": run.peer.name,
        "peer_label": run.label,
        "sweep": run.sweep,
        "nproc": run.nproc,
        "options": run.peer.options,
        "cap": cap_label(run.cap),
        "cap_bytes": run.cap,
        "repeat": run.repeat,
        "order": index,
        "device": common.device,
        "steps": common.steps,
        "warmup": common.warmup,
    }


def host_available_bytes(common: CommonSettings) -> int | None:
    """The host memory a run may take now (None: unknown, or the check is off)."""
    if not common.check_host_memory:
        return None
    if common.host_memory_bytes is not None:
        return common.host_memory_bytes
    memory = host_memory()
    return memory.available_bytes if memory is not None else None


def _gib_text(nbytes: float) -> str:
    gib = nbytes / GiB
    return f"{gib:.0f}" if gib >= 10 else f"{gib:.1f}"


def host_memory_reason(need: HostNeed, available: int) -> str:
    """``host memory: needs ~X GiB, the host has Y GiB available`` (the ranks when several)."""
    ranks = f" ({need.ranks} ranks x {_gib_text(need.per_rank)})" if need.ranks > 1 else ""
    return (
        f"{HOST_MEMORY_PREFIX} needs ~{_gib_text(need.total)} GiB{ranks}, the host has"
        f" {_gib_text(available)} GiB available"
    )


def host_check(run: RunSpec, common: CommonSettings) -> tuple[dict[str, Any], str | None]:
    """What the run's host memory estimate records, and why it must not start (None: it may)."""
    need = get_peer(run.peer.name).host_need(run.workload, run.peer.options, run.nproc)
    if need is None:
        return {}, None
    fields: dict[str, Any] = {
        "host_need_gib": need.total / GiB,
        "host_need_parts_gib": {k: v / GiB for k, v in need.parts.items()},
    }
    available = host_available_bytes(common)
    if available is None:
        return fields, None
    fields["host_available_gib"] = available / GiB
    return fields, host_memory_reason(need, available) if need.total > available else None


def _rank_rss(result_path: Path, rank0_gib: Any) -> list[float]:
    """Every rank's host RSS peak in GiB, rank 0's first (the other ranks write theirs beside
    the result: ``_worker.main``)."""
    ranks = [rank0_gib] if isinstance(rank0_gib, (int, float)) else []
    for path in sorted(result_path.parent.glob(f"{result_path.name}.rank*")):
        value = json.loads(path.read_text()).get("host_rss_peak_gib")
        if isinstance(value, (int, float)):
            ranks.append(value)
    return ranks


def run_one(run: RunSpec, common: CommonSettings, workdir: Path, index: int) -> dict[str, Any]:
    """Run ``run`` in a fresh ``python -m autooffload.bench._worker`` process; its result dict."""
    record = _record(run, common, index)
    reason = get_peer(run.peer.name).unavailable(run.workload, common.device)
    if reason:
        return {**record, "status": "skipped", "reason": reason}
    host_fields, reason = host_check(run, common)
    record.update(host_fields)
    if reason:
        return {**record, "status": "skipped", "reason": reason, "message": reason}
    spec_path = workdir / f"run{index:03d}.spec.json"
    result_path = workdir / f"run{index:03d}.result.json"
    log_dir = common.log_dir or workdir
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"run{index:03d}-{run.workload.name}-{run.peer.name}.log"
    spec = {
        "workload": run.workload.name,
        "overrides": workload_overrides(run.workload),
        "peer": run.peer.name,
        "options": run.peer.options,
        "device": common.device,
        "cap_bytes": run.cap,
        "steps": common.steps,
        "warmup": common.warmup,
        "seed": common.seed,
        "nproc": run.nproc,
        "result_path": str(result_path),
    }
    write_text_atomic(spec_path, json.dumps(spec))
    env = worker_env(run.nproc)
    cmd = [sys.executable, "-m", "autooffload.bench._worker", str(spec_path)]
    if run.nproc > 1:
        # One process per GPU under torchrun; rank 0 writes the result.
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={run.nproc}"]
        launcher.append(f"--master-port={_free_port()}")
        cmd = [*launcher, "-m", "autooffload.bench._worker", str(spec_path)]
    timeout_s = common.timeout_s
    if common.end is not None:
        timeout_s = max(0.0, min(timeout_s, common.end - time.monotonic()))
    with open(log_path, "w") as log:
        out = None if common.verbose else log
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout_s)
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as exc:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if isinstance(exc, KeyboardInterrupt):
                raise
            return {**record, "status": "timeout", "reason": f"killed after {timeout_s:.0f} s"}
    record["log"] = str(log_path) if common.log_dir else None
    if result_path.exists():
        result = {**record, **json.loads(result_path.read_text())}
        ranks = _rank_rss(result_path, result.get("host_rss_peak_gib"))
        if ranks:
            result["host_rss_ranks_gib"] = ranks
            result["host_rss_total_gib"] = sum(ranks)
        return result
    tail = _tail(log_path)
    reason = exit_reason(code, tail, run.nproc)
    record["message"] = reason
    return {**record, "status": "error", "reason": reason + ("\n" + tail if tail else "")}


def worker_env(nproc: int) -> dict[str, str]:
    """The environment of a worker process (of each rank's, for ``nproc`` > 1)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Every peer's worker waits passively in OpenMP, as a script run with python -m autooffload
    # does (autooffload/openmp.py): the CPU-optimizer peers (FSDP2-offload too) all gain.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if nproc > 1:
        # torchrun would set OMP_NUM_THREADS=1, leaving each rank's CPU optimizer
        # (DeepSpeedCPUAdam, FSDP2's AdamW) one core: each rank gets its share instead.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        env.setdefault("OMP_NUM_THREADS", str(max(1, (cores or 1) // nproc)))
    return env


def exit_reason(code: int, log_tail: str, nproc: int) -> str:
    """Why a worker that wrote no result ended, from its exit code and the end of its log."""
    reason = f"worker exited with code {code} and wrote no result"
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        hint = "; host out of memory?" if -code == signal.SIGKILL else ""
        reason += f" (killed by {name}{hint})"
    elif nproc > 1 and "SIGKILL" in log_tail:
        # torchrun exits 1 when a rank dies; its summary names the signal.
        reason += " (a rank was killed by SIGKILL; host out of memory?)"
    return reason


def run_all(
    runs: list[RunSpec],
    common: CommonSettings,
    on_result: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every run in order with a progress bar; ``on_result`` sees the results so far."""
    from tqdm import tqdm

    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="autooffload-bench-") as tmp:
        bar = tqdm(runs, unit="run", desc="bench", dynamic_ncols=True, file=sys.stderr)
        for index, run in enumerate(bar):
            bar.set_postfix_str(run.describe())
            pointless = _sweep_skip_reason(run, runs[:index], results)
            if pointless:
                reason = f"not run: {pointless}"
                result = {**_record(run, common, index), "status": "skipped", "reason": reason}
            elif common.deadline is not None and time.monotonic() >= common.deadline:
                reason = "not started: the --deadline was reached"
                result = {**_record(run, common, index), "status": "skipped", "reason": reason}
            else:
                result = run_one(run, common, Path(tmp), index)
            results.append(result)
            bar.write(_one_line(result, run.seq_sweep))
            if on_result is not None:
                on_result(results)
    return results


def sweep_outcome(result: dict[str, Any]) -> str | None:
    """What a sweep learns from a finished run: it fits, the GPU or the host ran out of memory,
    or it failed otherwise; None when it did not run (skipped, timed out)."""
    status = result.get("status")
    if status == "ok":
        return FITS
    if status == "OOM":
        return DEVICE_OOM
    if status == "error":
        # The kernel's OOM killer sends SIGKILL (runner's "killed by SIGKILL").
        return HOST_OOM if "SIGKILL" in (result.get("message") or "") else FAILED
    return None


def _sweep_skip_reason(
    run: RunSpec, earlier: list[RunSpec], results: list[dict[str, Any]]
) -> str | None:
    """Why ``run`` (a configuration of a sweep) is pointless after the runs of the same sweep,
    workload, cap, repeat and GPU count so far; None when it must run (or is not in a sweep)."""
    if run.sweep is None:
        return None
    sweep = get_peer(run.sweep).sweep
    same = (run.workload, run.cap, run.repeat, run.nproc, run.sweep)
    done = []
    for before, result in zip(earlier, results, strict=True):
        outcome = sweep_outcome(result)
        if (before.workload, before.cap, before.repeat, before.nproc, before.sweep) == same and (
            outcome is not None
        ):
            done.append((before.peer.options, outcome))
    return sweep.skip_reason(run.workload, run.peer.options, done) if sweep else None


def _one_line(result: dict[str, Any], show_seq: bool = False) -> str:
    seq = f" seq={result['seq']}" if show_seq else ""
    head = f"{result['workload']}{seq} cap={result['cap']} {result['peer_label']}:"
    head += f" {result['status']}"
    if result["status"] == "ok":
        step_ms = result["step_s_median"] * 1e3
        peak = result.get("peak_allocated_gib") or 0
        return (
            f"{head} {result['tokens_per_s']:.0f} tok/s, step {step_ms:.0f} ms,"
            f" peak {peak:.2f} GiB, loss {result['loss_final']:.4f}"
        )
    return f"{head} ({failure_message(result)})"


def failure_message(result: dict[str, Any]) -> str:
    """One line saying why a run did not finish ok."""
    if result.get("message"):
        return result["message"]
    reason = (result.get("reason") or "").strip().splitlines()
    return reason[-1] if reason else "no reason given"


def resolve_workloads(
    names: str,
    bs: int | None,
    seq: int | None,
    gc: bool | None,
    accum: int | None = None,
    layers: int | None = None,
) -> list[Workload]:
    """Comma-separated workload names -> workloads with overrides (clear error if unknown)."""
    return [
        get_workload(n.strip(), bs, seq, gc, accum, layers) for n in names.split(",") if n.strip()
    ]
