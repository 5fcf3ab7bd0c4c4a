"""Where the CPU update's time goes, pass by pass, and what fusing the passes would save (dev tool).

The worker does three passes per offloaded chunk: the bf16 staged gradient into an fp32 gradient
buffer, torch's fused AdamW over the chunk's params, and the fp32 master back into the bf16 host
copy. This times each on a worker thread (the runtime's thread count), the same over one flat
tensor per chunk, and a torch.compile'd single pass (read bf16 grad, update fp32 p/m/v, write
bf16 host) where a C++ compiler is available.

python devtools/cpu_update_fusion.py [threads]
"""

import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

threads = int(sys.argv[1]) if len(sys.argv) > 1 else max(1, (os.cpu_count() or 2) - 1)
# One Llama-3.2-3B decoder layer (hidden 3072, intermediate 8192, 8 of 24 heads for k/v): ~100M.
H, INTER, KV = 3072, 8192, 1024
shapes = [(H, H), (KV, H), (KV, H), (H, H), (INTER, H), (INTER, H), (H, INTER), (H,), (H,)]
LAYERS = int(os.environ.get("LAYERS", "3"))
shapes = shapes * LAYERS
n = sum(torch.Size(s).numel() for s in shapes)
REPEATS = 5


def make(flat: bool) -> dict:
    sizes = [torch.Size(s).numel() for s in shapes]
    if flat:
        sizes = [n]
    masters = [torch.randn(k) * 0.02 for k in sizes]
    staged = [torch.randn(k).to(torch.bfloat16) for k in sizes]
    hosts = [m.to(torch.bfloat16) for m in masters]
    grads = [torch.empty_like(m) for m in masters]
    opt = torch.optim.AdamW(masters, lr=1e-4, weight_decay=0.01, fused=True)
    return dict(masters=masters, staged=staged, hosts=hosts, grads=grads, opt=opt)


def passes(s: dict) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    for m, g, st in zip(s["masters"], s["grads"], s["staged"], strict=True):
        g.copy_(st)
        m.grad = g
    t1 = time.perf_counter()
    s["opt"].step()
    t2 = time.perf_counter()
    for m, h in zip(s["masters"], s["hosts"], strict=True):
        h.copy_(m)
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2


def fused_step(p, m, v, g16, h16, lr, beta1, beta2, eps, wd, bc1, bc2_sqrt):
    g = g16.float()
    p.mul_(1 - lr * wd)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (v.sqrt() / bc2_sqrt).add_(eps)
    p.addcdiv_(m, denom, value=-lr / bc1)
    h16.copy_(p)


def run_job(fn):
    pool = ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(threads,))
    try:
        return pool.submit(fn).result()
    finally:
        pool.shutdown()


def bench_passes(flat: bool) -> None:
    def job():
        s = make(flat)
        passes(s)  # state init
        times = [passes(s) for _ in range(REPEATS)]
        return [statistics.median(t[i] for t in times) for i in range(3)]

    a, b, c = run_job(job)
    total = a + b + c
    print(
        f"{'flat' if flat else 'per-param'} ({len(shapes) if not flat else 1} tensors):"
        f" grad copy {a * 1e3:.1f} ms ({n / a / 1e9:.2f} G/s), adamw {b * 1e3:.1f} ms"
        f" ({n / b / 1e9:.2f} G/s), host copy {c * 1e3:.1f} ms ({n / c / 1e9:.2f} G/s);"
        f" total {total * 1e3:.1f} ms = {n / total / 1e9:.2f} Gparam/s"
    )


def bench_compiled(flat: bool) -> None:
    def job():
        s = make(flat)
        passes(s)
        states = [s["opt"].state[m] for m in s["masters"]]
        compiled = torch.compile(fused_step, dynamic=False, fullgraph=True)
        # step-dependent scalars as 0-dim tensors: no recompile when lr or step change
        lr, bc1, bc2 = torch.tensor(1e-4), torch.tensor(0.5), torch.tensor(0.7)

        def once():
            t = time.perf_counter()
            for m, st, h, state in zip(s["masters"], s["staged"], s["hosts"], states, strict=True):
                compiled(
                    m,
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    st,
                    h,
                    lr,
                    0.9,
                    0.999,
                    1e-8,
                    0.01,
                    bc1,
                    bc2,
                )
            return time.perf_counter() - t

        t0 = time.perf_counter()
        once()
        warm = time.perf_counter() - t0
        return warm, statistics.median(once() for _ in range(REPEATS))

    try:
        warm, dt = run_job(job)
    except Exception as exc:  # noqa: BLE001 - a dev tool reports why
        print(
            f"compiled ({'flat' if flat else 'per-param'}): unavailable: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200]}"
        )
        return
    print(
        f"compiled single pass ({'flat' if flat else 'per-param'}): {dt * 1e3:.1f} ms ="
        f" {n / dt / 1e9:.2f} Gparam/s (first call incl. compile {warm:.1f} s)"
    )


print(
    f"cores {os.cpu_count()}, worker threads {threads}, {n / 1e6:.0f}M params,"
    f" torch {torch.__version__}"
)
for flat in (False, True):
    bench_passes(flat)
for flat in (False, True):
    bench_compiled(flat)
