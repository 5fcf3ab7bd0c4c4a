"""Where does an attached step's time go: torch.profiler over steady-state steps (dev tool).

python devtools/trace_step.py 1b 12      # autooffload under a 12 GiB cap
python devtools/trace_step.py 1b none    # vanilla, uncapped, same model and batch
"""

import collections
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM

import autooffload
from devtools._kernels import family

GiB = 1 << 30
size, cap_arg = sys.argv[1], sys.argv[2]
vanilla = cap_arg == "none"
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
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(**dims)).to(torch.bfloat16)
if not vanilla:
    cap = float(cap_arg)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(cap * GiB / total)
    autooffload.enable(budget=int(cap * GiB))
elif size != "1b":
    model.gradient_checkpointing_enable()
model.to("cuda")
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
x = torch.randint(0, dims["vocab_size"], (4, 1024)).cuda()


def step():
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad()


for _ in range(5):
    step()
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
before = torch.cuda.memory_stats()
t = time.perf_counter()
for _ in range(3):
    step()
torch.cuda.synchronize()
wall_clean = (time.perf_counter() - t) / 3
after = torch.cuda.memory_stats()
label = "vanilla" if vanilla else f"autooffload@{cap_arg}GiB"
print(
    f"== {size} {label}: step {wall_clean * 1e3:.1f} ms, {4 * 1024 / wall_clean:,.0f} tok/s, "
    f"peak {torch.cuda.max_memory_allocated() / GiB:.2f} GiB, reserved "
    f"{torch.cuda.memory_reserved() / GiB:.2f} GiB"
)
for key in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams"):
    print(f"   {key}: {after.get(key, 0) - before.get(key, 0)} over 3 steps")

if os.environ.get("TRACE", "1") == "0":
    if not vanilla:
        print("   stats", autooffload.runtime.runtime_of(model).stats())
    sys.exit(0)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    step()
    step()
    torch.cuda.synchronize()
if os.environ.get("OUT"):
    prof.export_chrome_trace(os.path.join(os.environ["OUT"], f"trace_{size}_{cap_arg}.json"))
ka = prof.key_averages()


fam_time: dict[str, float] = collections.Counter()
fam_n: dict[str, int] = collections.Counter()
for e in ka:
    if e.self_device_time_total <= 0:
        continue
    f = family(e.key)
    fam_time[f] += e.self_device_time_total / 2e3
    fam_n[f] += e.count // 2
total_dev = sum(v for k, v in fam_time.items() if not k.startswith("copy H") and k != "copy D2H")
print(f"   device time per step (kernels, not H2D/D2H copies): {total_dev:.1f} ms")
for f, v in sorted(fam_time.items(), key=lambda kv: -kv[1]):
    print(f"   DEV {v:8.1f} ms  n={fam_n[f]:6d}  {f}")
for e in sorted(ka, key=lambda e: -e.self_device_time_total)[:15]:
    print(f"   top {e.self_device_time_total / 2e3:8.1f} ms  n={e.count // 2:6d}  {e.key[:90]}")
for e in sorted(ka, key=lambda e: -e.self_cpu_time_total)[:12]:
    print(f"   cpu {e.self_cpu_time_total / 2e3:8.1f} ms  n={e.count // 2:6d}  {e.key[:90]}")
if not vanilla:
    rt = autooffload.runtime.runtime_of(model)
    print("   stats", rt.stats())
    request = rt.search_request
    print("   hw", request.hw)
    if os.environ.get("OUT"):
        import pickle

        with open(os.path.join(os.environ["OUT"], f"request_{size}_{cap_arg}.pkl"), "wb") as f:
            pickle.dump(request, f)
