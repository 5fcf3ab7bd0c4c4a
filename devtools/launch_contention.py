"""How much does CPU work beside it slow the thread that launches the GPU's kernels? (dev tool)

The main thread runs a TinyLlama decoder layer's forward (bs 4, seq 1024, bf16) again and again,
as a training step's forward does, and times the host side of each call (kernel launches, no
sync) and the GPU side (events). A worker thread meanwhile runs, in turn: nothing; torch's fused
AdamW over a 44M-param chunk (what the CPU update does) at several OpenMP thread counts; a bf16
copy of the same size (memory traffic alone); a Python loop (the GIL alone).

python devtools/launch_contention.py
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

N_CALLS = 60
CHUNK_NUMEL = 44 * 1024 * 1024


def layer_call() -> Callable[[], None]:
    config = LlamaConfig(
        hidden_size=2048,
        intermediate_size=5632,
        num_attention_heads=32,
        num_key_value_heads=4,
        num_hidden_layers=1,
    )
    config._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(config, 0).to("cuda", torch.bfloat16)
    x = torch.randn(4, 1024, 2048, device="cuda", dtype=torch.bfloat16)
    position_ids = torch.arange(1024, device="cuda")[None].expand(4, -1)
    rope = LlamaRotaryEmbedding(config).to("cuda")
    pos = rope(x, position_ids)

    def call() -> None:
        with torch.no_grad():
            layer(x, position_embeddings=pos, position_ids=position_ids)

    return call


def adam_work(threads: int) -> Callable[[threading.Event], None]:
    param = torch.zeros(CHUNK_NUMEL)
    param.grad = torch.randn(CHUNK_NUMEL)
    optimizer = torch.optim.AdamW([param], lr=1e-4, fused=True)

    def work(stop: threading.Event) -> None:
        torch.set_num_threads(threads)
        while not stop.is_set():
            optimizer.step()

    return work


def copy_work(threads: int) -> Callable[[threading.Event], None]:
    src = torch.randn(CHUNK_NUMEL)
    dst = torch.empty(CHUNK_NUMEL, dtype=torch.bfloat16)

    def work(stop: threading.Event) -> None:
        torch.set_num_threads(threads)
        while not stop.is_set():
            dst.copy_(src)

    return work


def python_work(stop: threading.Event) -> None:
    n = 0
    while not stop.is_set():
        n += 1


def measure(
    call: Callable[[], None],
    work: Callable[[threading.Event], None] | None,
    n_calls: int = N_CALLS,
) -> str:
    stop = threading.Event()
    thread = threading.Thread(target=work, args=(stop,)) if work else None
    if thread:
        thread.start()
        time.sleep(0.3)
    host, gpu = [], []
    for _ in range(n_calls):
        torch.cuda.synchronize()
        start_event, end_event = torch.cuda.Event(True), torch.cuda.Event(True)
        start = time.perf_counter()
        start_event.record()
        for _ in range(5):
            call()
        end_event.record()
        host.append((time.perf_counter() - start) / 5 * 1e3)
        end_event.synchronize()
        gpu.append(start_event.elapsed_time(end_event) / 5)
    stop.set()
    if thread:
        thread.join()
    return (
        f"host {statistics.median(host):.3f} ms/call (p90 {sorted(host)[int(0.9 * n_calls)]:.3f}),"
        f" GPU {statistics.median(gpu):.3f} ms/call"
    )


def main() -> None:
    call = layer_call()
    for _ in range(20):
        call()
    print(f"cores {torch.get_num_threads()} (torch threads); {torch.__config__.parallel_info()}")
    cases: list[tuple[str, Callable[[threading.Event], None] | None]] = [("idle", None)]
    for threads in (15, 8, 4, 1):
        cases.append((f"fused AdamW, {threads} threads", adam_work(threads)))
    cases += [("bf16 copy, 15 threads", copy_work(15)), ("bf16 copy, 1 thread", copy_work(1))]
    for name, work in cases:
        print(f"{name:28s} {measure(call, work)}", flush=True)
    # A GIL holder lets the launcher run once per switch interval (5 ms) at best: each call's
    # ~100 launches wait their turn, so a few calls say enough (60 x 5 took over 200 s).
    print(f"{'Python loop (GIL)':28s} {measure(call, python_work, n_calls=2)}", flush=True)
    print(f"{'idle again':28s} {measure(call, None)}", flush=True)


if __name__ == "__main__":
    main()
