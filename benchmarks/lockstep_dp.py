"""Cost of the ranks' start-of-phase exchange under sharded state
(``runtime/parallel/lockstep.py``).

Run under ``torchrun --nproc-per-node 2`` (CPU, gloo):

    torchrun --nproc-per-node 2 benchmarks/lockstep_dp.py --out lockstep.json

Two figures, on rank 0:

* ``micro``: ``--exchanges`` back-to-back ``Lockstep.check`` calls (the all-gather of three
  integers over the exchange's own gloo group, polling included): microseconds each.
* ``steps``: a small random-init Llama attached on the CPU with every chunk offloaded and
  sharded, trained ``--steps`` steps per round in alternating rounds with the exchange on and
  with ``Sharding.check_in_step`` stubbed out (ABAB), median step time of each. The exchange
  makes three calls per step (forward, backward start and end).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import autooffload
from autooffload import runtime as rt
from autooffload.runtime.parallel import lockstep, sharding


def micro(exchanges: int) -> float:
    """Microseconds per back-to-back exchange."""
    check = lockstep.Lockstep(dist.get_rank(), dist.get_world_size())
    for _ in range(20):
        check.check(lockstep.FORWARD_WITH_GRAD)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(exchanges):
        check.check(lockstep.FORWARD_WITH_GRAD)
    return (time.perf_counter() - start) / exchanges * 1e6


def steps(n_steps: int, rounds: int, hidden: int, layers: int) -> dict:
    """Median step seconds with the exchange on and stubbed out, alternating rounds."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
    )
    autooffload.enable(device="cpu", force_attach=True, mask=False, n_persist=0, chunk_size=8 << 20)
    model = LlamaForCausalLM(config).to("cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 4096, (2, 128), generator=torch.Generator().manual_seed(1))
    real = sharding.Sharding.check_in_step
    times: dict[str, list[float]] = {"on": [], "off": []}

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(3):  # profiling and plan switch
        step()
    for round_index in range(2 * rounds):
        mode = "on" if round_index % 2 == 0 else "off"
        sharding.Sharding.check_in_step = real if mode == "on" else lambda *a, **k: None
        dist.barrier()
        for _ in range(n_steps):
            start = time.perf_counter()
            step()
            times[mode].append(time.perf_counter() - start)
    sharding.Sharding.check_in_step = real
    runtime = rt.runtime_of(model)
    facts = {
        "params": sum(p.numel() for p in model.parameters()),
        "chunks": len(runtime.layout.chunks),
        "sharded": runtime.manager.sharding is not None,
        "exchanges": runtime.manager.sharding.lockstep.exchanges,
        "median_step_s_on": statistics.median(times["on"]),
        "median_step_s_off": statistics.median(times["off"]),
    }
    autooffload.disable()
    return facts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--exchanges", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    result = {
        "world_size": dist.get_world_size(),
        "threads": torch.get_num_threads(),
        "micro_us_per_exchange": micro(args.exchanges),
        "steps": steps(args.steps, args.rounds, args.hidden, args.layers),
    }
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
