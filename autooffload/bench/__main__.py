"""Command line of the bench: parse, plan the runs, run them, print the table, write JSON / PNG."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from autooffload.bench import plots, report, table
from autooffload.bench.cli_values import (
    cap_label,
    parse_caps,
    parse_options,
    parse_seqs,
    parse_size,
)
from autooffload.bench.peers import PEERS, public_peers
from autooffload.bench.runner import (
    CommonSettings,
    host_check,
    parse_peers,
    plan_runs,
    resolve_workloads,
    run_all,
)
from autooffload.bench.workloads import WORKLOADS, UnknownNameError

DEFAULT_PEERS = "vanilla,fsdp2_offload,deepspeed,autooffload"
RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def build_parser() -> argparse.ArgumentParser:
    workloads = ", ".join(WORKLOADS)
    parser = argparse.ArgumentParser(
        prog="python -m autooffload.bench",
        description="Benchmark autooffload against vanilla PyTorch, FSDP2-offload and DeepSpeed.",
    )
    parser.add_argument("--workload", help=f"one or a comma list of: {workloads}")
    parser.add_argument("--cap", help="GPU memory cap(s), e.g. 12GiB or 8GiB,12GiB,none (sweep)")
    parser.add_argument(
        "--vanilla-cap",
        help="cap(s) for the vanilla peer only (e.g. none: one uncapped reference per repeat)",
    )
    parser.add_argument(
        "--peers",
        default=DEFAULT_PEERS,
        help=f"comma list of {', '.join(public_peers())}; autooffload[k=v,...] for a fixed plan",
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps after warm-up")
    parser.add_argument(
        "--warmup",
        type=int,
        default=8,
        help="untimed warm-up steps (autooffload: 2 profile, 5 planned, the calibration, 1;"
        " up to 15 more while a re-planned plan is checked again)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="repeats (peers alternate: ABAB)")
    parser.add_argument("--bs", type=int, help="batch size (default: the workload's)")
    parser.add_argument(
        "--seq",
        help="sequence length(s), e.g. 8192 or 8192,16384,32768 (sweep; default: the workload's)",
    )
    parser.add_argument(
        "--gc",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="gradient checkpointing on/off (default: the workload's)",
    )
    parser.add_argument(
        "--accum",
        type=int,
        help="micro-batches per optimizer step (gradient accumulation; default 1); tokens/s"
        " counts them all",
    )
    parser.add_argument(
        "--layers",
        type=int,
        help="the text model's block count (default: the workload's); a shallower model at a"
        " length the full depth cannot run in the time at hand measures the length's"
        " per-block cost",
    )
    parser.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/...)")
    parser.add_argument(
        "--plot",
        nargs="?",
        const="",
        default=None,
        metavar="PATH",
        help="write a PNG (default: the JSON path with .png)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the runs and exit")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda if available")
    parser.add_argument(
        "--autooffload-opt",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="settings passed to autooffload.enable() (e.g. n_persist=4)",
    )
    parser.add_argument(
        "--nproc",
        type=_nprocs,
        default=[1],
        help="GPU count(s), e.g. 2 or 1,2: each run data-parallel over that many ranks (torchrun)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument(
        "--deadline",
        type=float,
        metavar="SECONDS",
        help="start no run after this many seconds (the rest are recorded as skipped)",
    )
    parser.add_argument(
        "--end-by",
        type=float,
        metavar="SECONDS",
        help="kill a run still going this many seconds after the start (status timeout)",
    )
    parser.add_argument(
        "--host-memory",
        metavar="SIZE",
        help="host memory a run's estimated need (DeepSpeed, save_on_cpu) is checked against:"
        " a size, or none (no check); default: what the host has available before each run",
    )
    parser.add_argument("--log-dir", type=Path, help="keep each worker's output here")
    parser.add_argument("--verbose", action="store_true", help="stream worker output")
    parser.add_argument(
        "--from-json",
        metavar="PATHS",
        help="re-print table / plots of results file(s); a comma list is merged (--out writes it)",
    )
    parser.add_argument("--list", action="store_true", help="list workloads and peers")
    return parser


def _list() -> None:
    print("workloads:")
    for workload in WORKLOADS.values():
        print(f"  {workload.describe()}  -- {workload.description}")
    print("peers:")
    for name in public_peers():
        print(f"  {name}: {PEERS[name].description}")


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _plot_path(args: argparse.Namespace, out: Path) -> Path | None:
    if args.plot is None:
        return None
    return Path(args.plot) if args.plot else out.with_suffix(".png")


def _from_json(args: argparse.Namespace) -> int:
    paths = [Path(part) for part in args.from_json.split(",") if part.strip()]
    payload = report.build_payload_from_files(paths)
    if args.out:
        report.write_json(args.out, payload)
        print(f"results: {args.out}")
    print(table.format_table(payload["summary"]))
    plot_path = _plot_path(args, args.out or paths[0])
    if plot_path:
        for path in plots.write_plots(payload, plot_path, payload.get("command", "")):
            print(f"plot: {path}")
    return 0


def _nprocs(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"invalid --nproc {text!r}; use e.g. 1, 2 or 1,2")
    return counts


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        _list()
        return 0
    if args.from_json:
        return _from_json(args)
    if not args.workload:
        parser.error(f"--workload is required; valid workloads: {', '.join(WORKLOADS)}")
    try:
        seqs = parse_seqs(args.seq)
        # One length overrides the workload's as before; several are expanded by plan_runs.
        single_seq = seqs[0] if seqs and len(seqs) == 1 else None
        workloads = resolve_workloads(
            args.workload, args.bs, single_seq, args.gc, args.accum, args.layers
        )
        swept_seqs = seqs if seqs and len(seqs) > 1 else None
        peers = parse_peers(args.peers, parse_options(args.autooffload_opt))
        caps = parse_caps(args.cap)
        vanilla_caps = parse_caps(args.vanilla_cap) if args.vanilla_cap else None
    except (UnknownNameError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    device = args.device or _default_device()
    runs = plan_runs(workloads, caps, peers, args.repeat, vanilla_caps, args.nproc, swept_seqs)
    common = CommonSettings(
        device, args.steps, args.warmup, args.seed, args.timeout, args.log_dir, args.verbose
    )
    if args.deadline is not None:
        common.deadline = started + args.deadline
    if args.end_by is not None:
        common.end = started + args.end_by
    if args.host_memory is not None:
        try:
            common.host_memory_bytes = parse_size(args.host_memory)
        except ValueError as exc:
            print(f"error: --host-memory: {exc}", file=sys.stderr)
            return 2
        common.check_host_memory = common.host_memory_bytes is not None
    date = dt.datetime.now()
    out = (
        args.out or RESULTS_DIR / f"{'+'.join(w.name for w in workloads)}-{date:%Y%m%d-%H%M%S}.json"
    )
    command = "python -m autooffload.bench " + shlex.join(argv)
    if args.dry_run:
        steps = f"{args.warmup} warm-up + {args.steps} timed steps"
        print(f"dry run: {len(runs)} runs on {device}, {steps}")
        for workload in workloads:
            for seq in swept_seqs or [workload.seq]:
                print(f"  {replace(workload, seq=seq).describe()}")
        for index, run in enumerate(runs):
            reason = PEERS[run.peer.name].unavailable(run.workload, device)
            host, too_large = host_check(run, common)
            reason = reason or too_large
            note = f"  (skipped: {reason})" if reason else ""
            if host and not reason:
                note = f"  (host memory ~{host['host_need_gib']:.1f} GiB)"
            print(f"  [{index}] {run.describe()}{note}")
        print(f"would write {out}")
        return 0
    meta: dict[str, Any] = {
        "command": command,
        "date": date.isoformat(timespec="seconds"),
        "host": platform.node(),
        "host_cpus": os.cpu_count(),
        "device": device,
        "args": {
            "workloads": [w.name for w in workloads],
            "caps": [cap_label(c) for c in caps],
            "peers": [p.label for p in peers],
            "steps": args.steps,
            "warmup": args.warmup,
            "repeat": args.repeat,
            "seed": args.seed,
            "seqs": swept_seqs,
        },
        # A --seq sweep records its lengths as the workload's seq.
        "workloads": {
            w.name: {**report.workload_meta(w), **({"seq": swept_seqs} if swept_seqs else {})}
            for w in workloads
        },
    }

    def save(results: list[dict[str, Any]]) -> None:
        report.write_json(out, report.build_payload(results, meta))

    results = run_all(runs, common, on_result=save)
    payload = report.build_payload(results, meta)
    report.write_json(out, payload)
    print(table.format_table(payload["summary"]))
    print(f"\nresults: {out}")
    plot_path = _plot_path(args, out)
    if plot_path:
        for path in plots.write_plots(payload, plot_path, command):
            print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
