"""One rank (``torchrun --nproc-per-node 1``) on a CUDA default group: the lockstep exchange's
gloo group (runtime/parallel/lockstep.py) takes the default group's timeout from its NCCL backend,
and an exchange runs. Writes ``<out>/rank0.json``."""

from __future__ import annotations

import argparse
import datetime
import json
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from autooffload.runtime.parallel.lockstep import FORWARD_WITH_GRAD, Lockstep, group_timeout

TIMEOUT = datetime.timedelta(seconds=17)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--backend", required=True)
    args = parser.parse_args()
    torch.cuda.set_device(0)
    dist.init_process_group(args.backend, timeout=TIMEOUT)
    report: dict = {"backend": str(dist.get_backend())}
    try:
        timeout = group_timeout()
        report["timeout_s"] = None if timeout is None else timeout.total_seconds()
        lockstep = Lockstep(0, 1)
        timeout = group_timeout(lockstep.group)
        report["lockstep_timeout_s"] = None if timeout is None else timeout.total_seconds()
        lockstep.issued(3)
        lockstep.check(FORWARD_WITH_GRAD)
        report["exchanges"] = lockstep.exchanges
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        report["error"] = traceback.format_exc()
    (args.out / "rank0.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
