"""One rank of the data-parallel fault test (``torchrun --nproc-per-node 2``): rank 1 raises in
the middle of a forward; rank 0 goes on into backward, where its gradient average waits for rank
1 until the process group's timeout. Each rank writes what it saw to ``<out>/rank<r>.json``."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from runtime_models import CHUNK_SIZE, batches, tiny_llama  # noqa: E402

import autooffload  # noqa: E402

TIMEOUT_S = 8


class Boom(Exception):
    pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    # exit: rank 1's process ends with the exception; stall: it catches it and stays alive
    # (a hung rank), so rank 0's collective can only end by the timeout.
    parser.add_argument("--mode", choices=["exit", "stall"], default="exit")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    autooffload.enable(
        device="cpu", force_attach=True, chunk_size=CHUNK_SIZE, mask=False, n_persist=1
    )
    model = tiny_llama().to("cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def fail(module, args, output):
        raise Boom(f"injected on rank {rank}")

    report: dict = {"rank": rank}
    started = time.monotonic()
    try:
        for step, ids in enumerate(batches(4)):
            if step == 2 and rank == 1:
                model.model.layers[1].mlp.register_forward_hook(fail)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        report["outcome"] = "finished"
    except Exception as error:  # noqa: BLE001 - what each rank saw is the test's subject
        report["outcome"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    report["seconds"] = time.monotonic() - started
    if rank == 1 and args.mode == "stall":
        (args.out / f"rank{rank}.json").write_text(json.dumps(report))
        time.sleep(3 * TIMEOUT_S)
    (args.out / f"rank{rank}.json").write_text(json.dumps(report))
    autooffload.disable()
    sys.exit(1 if report["outcome"] != "finished" else 0)


if __name__ == "__main__":
    main()
