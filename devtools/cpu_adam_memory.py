"""Fused CPU AdamW on bf16 chunks by where their memory comes from, alone and beside DMA (dev).

The runtime updates offloaded chunks in place in the pinned host store (``cudaHostAlloc``), with
the gradients read in the pinned staging, while H2D and D2H copies run. This times one
chunk-by-chunk update (one fused AdamW twin per ~100M-param chunk of Llama-3.2-3B layer shapes,
on a worker thread with the runtime's thread count) with params and gradients in:
  pageable    torch.empty (the CPU allocator; THP if the kernel gives it)
  pinned      torch.empty(pin_memory=True), as the host store and staging are
  registered  pageable memory page-locked afterwards with cudaHostRegister
each alone and with a thread keeping both copy directions busy (the step's PCIe traffic).

    python devtools/cpu_adam_memory.py [chunks] [threads]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

CHUNKS = int(sys.argv[1]) if len(sys.argv) > 1 else 8
THREADS = int(sys.argv[2]) if len(sys.argv) > 2 else max(1, (os.cpu_count() or 2) - 1)
H, INTER, KV = 3072, 8192, 1024
SHAPES = [(H, H), (KV, H), (KV, H), (H, H), (INTER, H), (INTER, H), (H, INTER), (H,), (H,)]
PER_CHUNK = sum(torch.Size(s).numel() for s in SHAPES)
REPEATS = 3


def flat(kind: str, numel: int) -> torch.Tensor:
    if kind == "pinned":
        return torch.zeros(numel, dtype=torch.bfloat16, pin_memory=True)
    t = torch.zeros(numel, dtype=torch.bfloat16)
    if kind == "registered":
        rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        assert int(rc) == 0, f"cudaHostRegister returned {rc}"
    return t


def views(buffer: torch.Tensor) -> list[torch.Tensor]:
    out, offset = [], 0
    for shape in SHAPES:
        n = torch.Size(shape).numel()
        out.append(buffer[offset : offset + n].view(shape))
        offset += n
    return out


def build(kind: str) -> list[torch.optim.Optimizer]:
    optimizers = []
    for _ in range(CHUNKS):
        weights, grads = flat(kind, PER_CHUNK), flat(kind, PER_CHUNK)
        grads.fill_(1e-3)
        params = [torch.nn.Parameter(v) for v in views(weights)]
        for p, g in zip(params, views(grads), strict=True):
            p.grad = g
        optimizers.append(torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True))
    return optimizers


def dma_load(stop: threading.Event, moved: list[int]) -> None:
    n = 256 << 20
    host_src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host_dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev_src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev_dst = torch.empty_like(dev_src)
    up, down = torch.cuda.Stream(), torch.cuda.Stream()
    while not stop.is_set():
        with torch.cuda.stream(up):
            dev_dst.copy_(host_src, non_blocking=True)
        with torch.cuda.stream(down):
            host_dst.copy_(dev_src, non_blocking=True)
        up.synchronize()
        down.synchronize()
        moved[0] += 2 * n


def timed(optimizers: list[torch.optim.Optimizer]) -> list[float]:
    def job() -> list[float]:
        for opt in optimizers:
            opt.step()  # state init
        rates = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            for opt in optimizers:
                opt.step()
            rates.append(CHUNKS * PER_CHUNK / (time.perf_counter() - start) / 1e9)
        return rates

    with ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(THREADS,)) as pool:
        return pool.submit(job).result()


def main() -> None:
    thp = "?"
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        pass
    result: dict = {"pid": os.getpid(), "threads": THREADS, "gparams": CHUNKS * PER_CHUNK / 1e9}
    result["thp"] = thp
    for kind in ("pageable", "pinned", "registered"):
        optimizers = build(kind)
        result[kind] = [round(r, 2) for r in timed(optimizers)]
        stop, moved = threading.Event(), [0]
        loader = threading.Thread(target=dma_load, args=(stop, moved), daemon=True)
        loader.start()
        time.sleep(0.2)
        start, before = time.perf_counter(), moved[0]
        result[kind + "+dma"] = [round(r, 2) for r in timed(optimizers)]
        gbps = (moved[0] - before) / (time.perf_counter() - start) / 1e9
        stop.set()
        loader.join()
        result[kind + "+dma_GBps"] = round(gbps, 1)
        result[kind + "_median"] = statistics.median(result[kind])
        del optimizers
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
