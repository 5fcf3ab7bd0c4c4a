"""How fast is the CPU optimizer path here: fused AdamW step, bf16<->fp32 copies, main vs worker
thread, thread counts, and with a busy main thread launching GPU work (dev tool)."""

import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

N_TENSORS, SIZE = 44, 2048 * 5632  # ~0.5B params
params = [torch.randn(SIZE) for _ in range(N_TENSORS)]
for p in params:
    p.grad = torch.randn(SIZE)
staged = [torch.randn(SIZE).to(torch.bfloat16) for _ in range(N_TENSORS)]
hosts = [torch.empty(SIZE, dtype=torch.bfloat16) for _ in range(N_TENSORS)]
n = N_TENSORS * SIZE
print("cores", os.cpu_count(), "torch threads", torch.get_num_threads())


def adam(opt):
    t = time.perf_counter()
    opt.step()
    return time.perf_counter() - t


def copies():
    t = time.perf_counter()
    for p, s in zip(params, staged):
        p.grad.copy_(s)
    a = time.perf_counter() - t
    t = time.perf_counter()
    for p, h in zip(params, hosts):
        h.copy_(p)
    return a, time.perf_counter() - t


for fused in (True, False):
    opt = torch.optim.AdamW(params, lr=1e-4, fused=fused, foreach=None if fused else True)
    adam(opt)
    print(f"main thread fused={fused}: {n / adam(opt) / 1e9:.2f} Gparam/s")
opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
adam(opt)
a, b = copies()
print(f"copy bf16->fp32 grad {n / a / 1e9:.2f} Gel/s, fp32->bf16 host {n / b / 1e9:.2f} Gel/s")
pool = ThreadPoolExecutor(1)
print("worker threads", pool.submit(torch.get_num_threads).result())
for threads in (None, 15, 14, 12, 8):

    def job(threads=threads):
        if threads:
            torch.set_num_threads(threads)
        return adam(opt), copies()

    dt, (a, b) = pool.submit(job).result()
    print(
        f"worker threads={threads}: adam {n / dt / 1e9:.2f} Gparam/s,"
        f" copies {n / a / 1e9:.2f}/{n / b / 1e9:.2f} Gel/s"
    )
print("main threads now", torch.get_num_threads())
if torch.cuda.is_available():
    x = torch.randn(256, 256, device="cuda")

    def launches(k=20000):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(k):
            x.add_(1.0)
        torch.cuda.synchronize()
        return k / (time.perf_counter() - t)

    print(f"launch rate idle: {launches():.0f}/s")
    for threads in (16, 14, 12):

        def job(threads=threads):
            torch.set_num_threads(threads)
            return adam(opt)

        f = pool.submit(job)
        time.sleep(0.05)
        rate = launches()
        dt = f.result()
        print(
            f"launch rate during cpu adam threads={threads}: {rate:.0f}/s;"
            f" adam {n / dt / 1e9:.2f} Gparam/s"
        )
