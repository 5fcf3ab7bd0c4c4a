"""Where does an attached step's time go: torch.profiler over one steady-state step (dev tool)."""

import cProfile
import io
import pstats
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM

import autooffload

GiB = 1 << 30
size, cap = sys.argv[1], float(sys.argv[2])
dims = (
    dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=32000,
    )
    if size == "1b"
    else dict(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
    )
)
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(cap * GiB / total)
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(**dims)).to(torch.bfloat16)
autooffload.enable(budget=int(cap * GiB))
model.to("cuda")
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
x = torch.randint(0, dims["vocab_size"], (4, 1024)).cuda()


def step():
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad()


for _ in range(4):
    step()
torch.cuda.synchronize()


with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    t = time.perf_counter()
    step()
    step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / 2
ka = prof.key_averages()
copies = (
    sum(e.self_device_time_total for e in ka if "Memcpy" in e.key or "memcpy" in e.key) / 1e6 / 2
)
kernels = (
    sum(e.self_device_time_total for e in ka if "Memcpy" not in e.key and "memcpy" not in e.key)
    / 1e6
    / 2
)
print(f"wall per step {wall:.3f}s; kernels {kernels:.3f}s; copies {copies:.3f}s (copy engines)")
rows = sorted(ka, key=lambda e: -e.self_cpu_time_total)[:25]
for e in rows:
    print(f"CPU {e.self_cpu_time_total / 2e3:8.1f} ms  n={e.count // 2:6d}  {e.key[:70]}")
rows = sorted(ka, key=lambda e: -e.self_device_time_total)[:12]
for e in rows:
    print(f"DEV {e.self_device_time_total / 2e3:8.1f} ms  n={e.count // 2:6d}  {e.key[:70]}")
pr = cProfile.Profile()
torch.cuda.synchronize()
t = time.perf_counter()
pr.enable()
step()
torch.cuda.synchronize()
pr.disable()
print("cprofile step wall", time.perf_counter() - t)
out = io.StringIO()
pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(22)
print(out.getvalue()[-6000:])
print("stats", autooffload.runtime.runtime_of(model).stats())
