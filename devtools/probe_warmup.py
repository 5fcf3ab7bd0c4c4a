"""Does the block probe's best-of-N depend on the GPU having been idle? (dev tool)

python devtools/probe_warmup.py
Times one Llama-3.2-3B-dims decoder layer (bf16, bs 4, seq 1024) forward and backward with CUDA
events, as ``runtime/control/profiler.py``'s probe does, after the GPU idled for a second: the
per-run times of 20 runs in order, so the first runs (the probe's best of 3) can be compared
with the steady state.
"""

from __future__ import annotations

import time

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding


def main() -> None:
    config = LlamaConfig(
        hidden_size=3072,
        intermediate_size=8192,
        num_attention_heads=24,
        num_key_value_heads=8,
        num_hidden_layers=28,
        head_dim=128,
    )
    config._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(config, 0).cuda().to(torch.bfloat16)
    rotary = LlamaRotaryEmbedding(config).cuda()
    x = torch.randn(4, 1024, 3072, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(1024, device="cuda")[None].expand(4, -1)
    emb = rotary(x, positions)
    params = [p for p in layer.parameters()]

    def run() -> tuple[float, float]:
        inp = x.detach().requires_grad_(True)
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        out = layer(inp, position_embeddings=emb)
        out = out[0] if isinstance(out, tuple) else out
        mid.record()
        torch.autograd.grad(out, [inp, *params], torch.ones_like(out))
        end.record()
        end.synchronize()
        return start.elapsed_time(mid), mid.elapsed_time(end)

    for label, pause in (("cold (1 s idle)", 1.0), ("again after 1 s idle", 1.0), ("warm", 0.0)):
        time.sleep(pause)
        times = [run() for _ in range(20)]
        fwd = [f"{f:.2f}" for f, _ in times]
        bwd = [f"{b:.2f}" for _, b in times]
        print(f"{label}: fwd ms {' '.join(fwd)}")
        print(f"{' ' * len(label)}  bwd ms {' '.join(bwd)}")
        best3 = min(f for f, _ in times[:3]), min(b for _, b in times[:3])
        best20 = min(f for f, _ in times), min(b for _, b in times)
        print(f"  best of 3: {best3[0]:.2f} / {best3[1]:.2f} ms", end="; ")
        print(f"best of 20: {best20[0]:.2f} / {best20[1]:.2f} ms")


if __name__ == "__main__":
    main()
