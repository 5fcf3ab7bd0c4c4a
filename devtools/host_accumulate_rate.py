"""Host gradient accumulation rates: fp32 host gradients += bf16 staged gradients, several ways.

The CPU side of gradient accumulation (runtime/update/grad_staging.py ``_accumulate``) adds each
offloaded chunk's staged low-precision gradients onto fp32 host gradients at every micro-batch after
the first. This times the candidate kernels on this host's threads, beside the fused AdamW step, so
the accumulation's cost can be judged against the update's.

    python devtools/host_accumulate_rate.py [numel_millions=512] [tensors=8]
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch


def rate(fn: Callable[[], object], numel: int, repeats: int = 3) -> float:
    """Gparam/s of ``fn`` over ``numel`` elements (one warm-up call)."""
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return numel * repeats / (time.perf_counter() - start) / 1e9


def main() -> None:
    total = int(float(sys.argv[1]) * 1e6) if len(sys.argv) > 1 else 512_000_000
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    n = total // count
    grads = [torch.zeros(n) for _ in range(count)]
    staged = [torch.randn(n).bfloat16() for _ in range(count)]
    staged32 = [torch.randn(n) for _ in range(count)]
    print(f"threads {torch.get_num_threads()}, {count} tensors of {n / 1e6:.0f}M")
    cases: dict[str, Callable[[], object]] = {
        "foreach_add_ fp32 += bf16": lambda: torch._foreach_add_(grads, staged),
        "foreach_add_ fp32 += fp32": lambda: torch._foreach_add_(grads, staged32),
        "foreach_copy_ fp32 <- bf16": lambda: torch._foreach_copy_(grads, staged),
    }
    for block in (1 << 18, 1 << 20, 1 << 22):
        left = [v for g in grads for v in g.split(block)]
        right = [v for s in staged for v in s.split(block)]
        name = f"foreach_add_ fp32 += bf16 in {block >> 10}K views"
        cases[name] = lambda left=left, right=right: torch._foreach_add_(left, right)
    for name, fn in cases.items():
        print(f"{name}: {rate(fn, total):.2f} Gparam/s")
    params = [torch.zeros(n) for _ in range(2)]
    for p in params:
        p.grad = torch.randn(n)
    opt = torch.optim.AdamW(params, fused=True)
    print(f"AdamW fused step: {rate(opt.step, 2 * n):.2f} Gparam/s")


if __name__ == "__main__":
    main()
