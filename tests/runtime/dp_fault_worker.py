"""One rank of the data-parallel fault tests (``torchrun --nproc-per-node 2``). ``exit`` and
``stall``: rank 1 raises in the middle of a forward; rank 0 goes on into backward, where it
waits for rank 1 until the process group's timeout. ``alone``: rank 0 evaluates a batch that
rank 1 does not (it trains); ``barrier``: rank 0 evaluates while rank 1 waits in a barrier;
``branch``: a module runs on rank 0 only, in every forward; ``sequence``: rank 1 counts a
chunk collective it did not issue (as if its forward had skipped or added one).
Each rank writes what it saw to ``<out>/rank<r>.json``."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from dp_worker import branch_model  # noqa: E402
from runtime_models import CHUNK_SIZE, batches, tiny_llama  # noqa: E402

import autooffload  # noqa: E402
from autooffload import runtime as rt  # noqa: E402
from autooffload.runtime.parallel import lockstep  # noqa: E402

TIMEOUT_S = 8


class Boom(Exception):
    pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    # exit: rank 1's process ends with the exception; stall: it catches it and stays alive
    # (a hung rank), so rank 0's collective can only end by the timeout.
    modes = ["exit", "stall", "alone", "barrier", "branch", "sequence"]
    parser.add_argument("--mode", choices=modes, default="exit")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    lockstep.STALL_WARNING_S = 1.0
    autooffload.enable(
        device="cpu", force_attach=True, chunk_size=CHUNK_SIZE, mask=False, n_persist=1
    )
    if args.mode == "branch":
        model = branch_model("cpu", torch.float32)
        model.branch_on = rank == 0
    else:
        model = tiny_llama().to("cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def fail(module, args, output):
        raise Boom(f"injected on rank {rank}")

    report: dict = {"rank": rank}
    started = time.monotonic()
    try:
        for step, ids in enumerate(batches(4)):
            if step == 2 and rank == 1 and args.mode in ("exit", "stall"):
                model.model.layers[1].mlp.register_forward_hook(fail)
            if step == 2 and rank == 0 and args.mode in ("alone", "barrier"):
                started = time.monotonic()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    try:
                        with torch.no_grad():
                            model(input_ids=ids)
                    finally:
                        report["warnings"] = [str(w.message) for w in caught]
            if step == 2 and rank == 1 and args.mode == "sequence":
                started = time.monotonic()
                rt.runtime_of(model).manager.sharding.lockstep.issued(3)
            if step == 2 and rank == 1 and args.mode == "barrier":
                started = time.monotonic()
                dist.barrier()
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        report["outcome"] = "finished"
    except Exception as error:  # noqa: BLE001 - what each rank saw is the test's subject
        report["outcome"] = f"{type(error).__name__}: {str(error).splitlines()[0][:600]}"
    report["seconds"] = time.monotonic() - started
    if rank == 1 and args.mode == "stall":
        (args.out / f"rank{rank}.json").write_text(json.dumps(report))
        time.sleep(3 * TIMEOUT_S)
    (args.out / f"rank{rank}.json").write_text(json.dumps(report))
    autooffload.disable()
    sys.exit(1 if report["outcome"] != "finished" else 0)


if __name__ == "__main__":
    main()
