"""One rank of the multi-node test, launched by ``torchrun`` on one node (``--nproc-per-node 4``)
or as one of two simulated nodes (``--nnodes 2 --node-rank R --nproc-per-node 2``, rendezvous on
localhost): data-parallel training of an attached model, and a checkpoint resumed at the same
world size; with ``--resume-from``, only that checkpoint resumed at this launch's world size.
``--device cpu`` runs over gloo, ``--device cuda`` over NCCL with each rank on
``cuda:LOCAL_RANK``. Writes ``<out>/rank<r>.json`` and, on rank 0, the trained weights."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from dp_worker import (  # noqa: E402
    STEPS,
    case_dp,
    case_resume,
    max_diff,
    resume_from,
    train_plain,
    weights,
)

from autooffload.runtime.parallel.distributed import local_world_size  # noqa: E402


def train(device: str, rank: int, world: int, out: Path, report: dict) -> None:
    """Attached data-parallel training and its checkpoint resumed, each against the
    single-process reference averaging ``world`` parts of every global batch."""
    averaged = weights(train_plain(device, torch.float32, STEPS, world=world)[0])
    dp, report["sharding"] = case_dp(device, torch.float32, rank, world)
    report["dp_vs_averaged"] = max_diff(dp, averaged)
    resumed = case_resume(device, torch.float32, rank, world, out)
    report["resume_vs_averaged"] = max_diff(resumed, averaged)
    if rank == 0:
        torch.save({"dp": dp, "averaged": averaged}, out / "trained.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--resume-from", type=Path, default=None)
    args = parser.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    report: dict = {
        "rank": rank,
        "world": world,
        "local_world_size": local_world_size(),
        "node_rank": int(os.environ.get("GROUP_RANK", "0")),
        "backend": dist.get_backend(),
    }
    try:
        if args.resume_from is None:
            train(args.device, rank, world, args.out, report)
        else:
            resumed = resume_from(args.resume_from, args.device, torch.float32, rank, world)
            if rank == 0:
                torch.save(resumed, args.out / "resumed.pt")
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        report["error"] = traceback.format_exc()
    (args.out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
