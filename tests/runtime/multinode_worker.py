"""One rank of the multi-node test, launched by ``torchrun`` on one node (``--nproc-per-node 4``)
or as one of two simulated nodes (``--nnodes 2 --node-rank R --nproc-per-node 2``, rendezvous on
localhost): data-parallel training of an attached model, and a checkpoint resumed at the same
world size. Writes ``<out>/rank<r>.json`` and, on rank 0, the trained weights."""

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
from dp_worker import STEPS, case_dp, case_resume, max_diff, train_plain, weights  # noqa: E402

from autooffload.runtime.parallel.distributed import local_world_size  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    report: dict = {
        "rank": rank,
        "world": world,
        "local_world_size": local_world_size(),
        "node_rank": int(os.environ.get("GROUP_RANK", "0")),
    }
    try:
        averaged = weights(train_plain("cpu", torch.float32, STEPS, world=world)[0])
        dp, report["sharding"] = case_dp("cpu", torch.float32, rank, world)
        report["dp_vs_averaged"] = max_diff(dp, averaged)
        resumed = case_resume("cpu", torch.float32, rank, world, args.out)
        report["resume_vs_averaged"] = max_diff(resumed, averaged)
        if rank == 0:
            torch.save({"dp": dp, "averaged": averaged}, args.out / "trained.pt")
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        report["error"] = traceback.format_exc()
    (args.out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
