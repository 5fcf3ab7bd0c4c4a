"""Fused CPU AdamW throughput of one process over a model-sized set of fp32 params: run it in
several processes to see how much the rate varies between processes on one machine.

    python devtools/cpu_adam_variance.py --gparams 1.0 --steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gparams", type=float, default=1.0, help="billions of fp32 params")
    parser.add_argument("--tensor-mparams", type=float, default=50.0, help="params per tensor (M)")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    per = int(args.tensor_mparams * 1e6)
    n = max(1, int(args.gparams * 1e9) // per)
    start = time.perf_counter()
    params = [torch.zeros(per, requires_grad=True) for _ in range(n)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    alloc_s = time.perf_counter() - start
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    rates = []
    for _ in range(args.steps):
        start = time.perf_counter()
        optimizer.step()
        rates.append(n * per / (time.perf_counter() - start) / 1e9)
    print(
        json.dumps(
            {
                "pid": os.getpid(),
                "threads": torch.get_num_threads(),
                "alloc_s": round(alloc_s, 2),
                "gparam_per_s": [round(r, 2) for r in rates],
                "thp_env": os.environ.get("THP_MEM_ALLOC_ENABLE"),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
