"""Quick GPU check: bf16 equivalence and throughput under caps (dev tool, not the harness)."""

import copy
import gc
import json
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import autooffload
from autooffload import runtime as rt

GiB = 1 << 30


def tiny(tied=True):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


def run(model, attach, steps=10, **kw):
    if attach:
        autooffload.enable(force_attach=True, chunk_size=1 << 20, **kw)
    model.to("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 512, (2, 64), generator=g).cuda()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if attach:
        autooffload.disable()
    return losses


if "eq" in sys.argv:
    base = tiny()
    l0 = run(copy.deepcopy(base), False)
    for kw in (
        dict(master_weights=False),
        dict(master_weights=False, activation_mode="swap"),
        dict(n_persist=0, master_weights=False),
    ):
        l1 = run(copy.deepcopy(base), True, **kw)
        print("EQ", kw, "max loss diff", max(abs(a - b) for a, b in zip(l0, l1)), l0[-1], l1[-1])

DIMS = {
    "1b": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=32000,
    ),
    "3b": dict(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
}


def bench(size, attach, cap=None, gc_on=False, steps=8, **kw):
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total) if cap else 1.0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=2048, **DIMS[size])).to(
        torch.bfloat16
    )
    if gc_on:
        model.gradient_checkpointing_enable()
    if attach:
        autooffload.enable(budget=cap, **kw)
    model.to("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, DIMS[size]["vocab_size"], (4, 1024)).cuda()
    times = []
    res = dict(size=size, peer="auto" if attach else "vanilla", cap=cap and cap / GiB, kw=kw)
    try:
        for s in range(steps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            if s == 1:
                torch.cuda.reset_peak_memory_stats()
        med = sorted(times[2:])[len(times[2:]) // 2]
        res.update(
            step=round(med, 3),
            toks=round(4096 / med),
            peak=round(torch.cuda.max_memory_allocated() / GiB, 2),
            reserved=round(torch.cuda.max_memory_reserved() / GiB, 2),
            loss=round(loss.item(), 3),
        )
        if attach:
            r = rt.runtime_of(model)
            p = r.plan
            res.update(
                pred_peak=round(p.predicted_peak_bytes / GiB, 2),
                pred_step=round(p.predicted_step_s, 3),
                stats={k: round(v, 3) if isinstance(v, float) else v for k, v in r.stats().items()},
            )
            print(p.summary())
            prof = getattr(r, "profile", None)
            if prof is not None:
                for u in (prof.pre, prof.blocks[0], prof.blocks[-1], prof.post):
                    print(
                        "UNIT",
                        u.name,
                        f"fwd {u.fwd_s * 1e3:.2f}ms bwd {u.bwd_s * 1e3:.2f}ms",
                        f"keep {u.act_bytes_keep / 2**20:.0f}MiB",
                        f"ckpt {u.act_bytes_checkpoint / 2**20:.0f}MiB",
                        f"tf {u.fwd_transient_bytes / 2**20:.0f}",
                        f"tb {u.bwd_transient_bytes / 2**20:.0f}",
                    )
                print(
                    "PROFILE static",
                    prof.static_bytes / 2**20,
                    "tokens",
                    prof.batch_tokens,
                    "breakdown",
                    {k: round(v, 4) for k, v in p.breakdown.items()},
                )
    except torch.OutOfMemoryError:
        res["status"] = "OOM"
    print("RESULT", json.dumps(res), flush=True)
    if attach:
        autooffload.disable()
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()


for spec in sys.argv[1:]:
    if spec == "eq":
        continue
    size, peer, cap, gcflag = spec.split(":")
    bench(size, peer == "auto", int(float(cap) * GiB) if cap != "-" else None, gcflag == "gc")
