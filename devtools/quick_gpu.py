"""Quick GPU check: bf16 equivalence and 1.1B throughput (dev tool, not the benchmark harness)."""
import copy, time, sys, os, gc
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import autooffload
from autooffload import runtime as rt

def tiny(tied=True):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg).to(torch.bfloat16)

def run(model, attach, steps=10, **kw):
    if attach:
        autooffload.enable(force_attach=True, chunk_size=1<<20, **kw)
    model.to("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for s in range(steps):
        x = torch.randint(0, 512, (2, 64), generator=g).cuda()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(); opt.zero_grad()
        losses.append(loss.item())
    if attach:
        r = rt.runtime_of(model); print(r.stats()); autooffload.disable()
    return losses

base = tiny()
l0 = run(copy.deepcopy(base), False)
for mw in (False, True):
    for npersist in (0, 3):
        l1 = run(copy.deepcopy(base), True, master_weights=mw, n_persist=npersist)
        print("master", mw, "npersist", npersist, "max loss diff", max(abs(a-b) for a,b in zip(l0,l1)), l0[-1], l1[-1])

def bench(attach, steps=8, **kw):
    torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
        num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    if attach:
        autooffload.enable(**kw)
    t0=time.perf_counter(); model.to("cuda"); print("to cuda", time.perf_counter()-t0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, 32000, (4, 1024)).cuda()
    times=[]
    for s in range(steps):
        torch.cuda.synchronize(); t=time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward(); opt.step(); opt.zero_grad()
        torch.cuda.synchronize(); times.append(time.perf_counter()-t)
    med = sorted(times[2:])[len(times[2:])//2]
    print(("auto" if attach else "vanilla"), kw, "step", round(med,3), "tok/s", round(4096/med), "peak GiB", round(torch.cuda.max_memory_allocated()/2**30,2), "loss", loss.item())
    if attach:
        r = rt.runtime_of(model); print(r.plan.summary()); print(r.stats()); autooffload.disable()
    del model, opt; gc.collect(); torch.cuda.empty_cache()

bench(False)
bench(True, budget="12GiB")
bench(True, budget="12GiB", n_persist=0)
