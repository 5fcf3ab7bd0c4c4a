"""Host memory per data-parallel rank, sharded vs replicated model states (CPU, gloo).

Run under ``torchrun --nproc-per-node N`` (any N); one launch per mode, since a process's
peak RSS only grows:

    torchrun --nproc-per-node 2 benchmarks/host_memory_dp.py --shard on  --out r_on.json
    torchrun --nproc-per-node 2 benchmarks/host_memory_dp.py --shard off --out r_off.json

Each rank builds the same random-init Llama (bf16, from a config: nothing is downloaded),
attaches it on the CPU with every chunk offloaded, trains two AdamW steps and reports its
host store, gradient staging, masters and optimizer state bytes and its peak RSS. Rank 0
writes the ranks' figures to ``--out``. The GPU is not involved: what is measured is where
the host bytes live, which is the same code on CUDA (there the host store is pinned).
"""

from __future__ import annotations

import argparse
import json
import resource
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import autooffload

GIB = 1 << 30


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shard", choices=["on", "off"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    autooffload.enable(
        device="cpu",
        force_attach=True,
        n_persist=0,
        activation_mode="checkpoint",
        shard_optimizer=args.shard,
        chunk_size=32 << 20,
        mask=False,
        log="warning",
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=4,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16).to("cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(2):
        ids = torch.randint(0, 32000, (1, 64))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    from autooffload import runtime as rt

    runtime = rt.runtime_of(model)
    cpu_optim = runtime.cpu_optim
    state = sum(
        t.numel() * t.element_size()
        for chunk in runtime.layout.chunks
        for twin in cpu_optim.twins.of_chunk(chunk)
        for s in twin.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    masters = sum(
        m.numel() * m.element_size() for m in cpu_optim.masters.values() if m.dtype == torch.float32
    )
    row = {
        "rank": rank,
        "params": sum(p.numel() for p in model.parameters()),
        "host_store_gib": runtime.manager.host.total_bytes / GIB,
        "grad_staging_gib": runtime.manager.grads.staging.total_bytes / GIB,
        "masters_gib": masters / GIB,
        "optimizer_state_gib": state / GIB,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
    }
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        result = {"shard": args.shard, "world": world, "ranks": rows}
        args.out.write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1))
    autooffload.disable()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
