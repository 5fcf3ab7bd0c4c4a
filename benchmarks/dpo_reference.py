"""DPO with a reference model under a GPU memory cap: plain PyTorch vs autooffload.

    python benchmarks/dpo_reference.py --cap 24GiB --out dpo.json

Two random-init Llama-3.2-3B-shaped models in bf16 (from a config: nothing is downloaded): the
policy, fully fine-tuned with fused AdamW, and a frozen copy of it as the DPO reference, run
under ``no_grad`` each step before the policy's forward and backward, as TRL's DPOTrainer does.
A step is ``--pairs`` (chosen, rejected) pairs of ``--seq`` tokens. Each peer runs in its own
process:

* ``plain``: no autooffload, no cap (the reference speed and memory);
* ``plain@cap``: no autooffload, ``torch.cuda.set_per_process_memory_fraction`` at the cap;
* ``autooffload@cap``: ``autooffload.enable(budget=cap)`` and the same fraction: the policy
  attaches and is planned, the reference attaches frozen and streams (``offload_frozen`` auto);
* ``autooffload[offload_frozen=0]@cap``: the reference moved whole to the GPU, the policy's
  plan made around it.

Steps are timed once ``--warmup`` steps are done and the policy's plan has settled (its profiling
steps and first calibration over), as ``autooffload.bench`` times: a plan switch empties the
allocator's cache and resets the peak counters. Peaks are each timed step's, from a reset at its
start. Reported per peer: step ms (median of ``--steps``), pairs/s and tokens/s, peak allocated and
reserved GiB, the reference forward's share of the step, the policy plan's predicted peak and
step; ``OOM`` where the peer ran out of memory.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

from peer_processes import LLAMA_3B, parse_bytes, run_peer

GIB = 1 << 30
DIMS = LLAMA_3B
# Llama-3-8B's shape (untied, 128k vocabulary), for --shape 8b.
DIMS_8B = dict(
    DIMS,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    tie_word_embeddings=False,
)
BETA = 0.1


def dims() -> dict:
    return DIMS_8B if os.environ.get("DPO_SHAPE") == "8b" else DIMS


def build(layers: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**dims(), "num_hidden_layers": layers})
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    # Drawn on the GPU a tensor at a time (a CPU normal_ over 3.2B params takes minutes).
    generator = torch.Generator(device="cuda").manual_seed(0)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            drawn = torch.empty(param.shape, dtype=param.dtype, device="cuda")
            param.data.copy_(drawn.normal_(0.0, 0.02, generator=generator))
    torch.cuda.empty_cache()
    return model.train()


def sequence_logps(model, ids):
    import torch.nn.functional as F

    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    return -F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").sum(-1)


def peer(args: argparse.Namespace) -> dict:
    """One peer, in this process: build, attach or not, train; its figures."""
    import torch
    import torch.nn.functional as F

    import autooffload
    from autooffload import runtime as rt

    name = args.peer
    cap = parse_bytes(args.cap) if "@cap" in name else None
    result: dict = {"peer": name, "cap_gib": cap / GIB if cap else None}
    clock = time.perf_counter()
    policy = build(args.layers)
    reference = copy.deepcopy(policy).requires_grad_(False).eval()
    print(f"[{name}] built in {time.perf_counter() - clock:.1f} s", file=sys.stderr, flush=True)
    if cap is not None:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(cap / total)
    if name.startswith("autooffload"):
        settings = {"offload_frozen": False} if "offload_frozen=0" in name else {}
        autooffload.enable(budget=cap, log="info", mask=False, **settings)
    try:
        start = time.perf_counter()
        policy.to("cuda")
        reference.to("cuda")
        result["move_s"] = time.perf_counter() - start
        result["policy_attached"] = rt.runtime_of(policy) is not None
        result["reference_attached"] = rt.runtime_of(reference) is not None
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-5, fused=True)
        generator = torch.Generator().manual_seed(0)
        times, ref_times, losses, peaks, reserved = [], [], [], [], []
        runtime = rt.runtime_of(policy)
        step, timed_from = 0, None
        # Timed once warmed up and the policy's plan has settled (its profiling steps and
        # first calibration over: a plan switch empties the cache and resets the peak
        # counters), as autooffload.bench times; at most --max-warmup steps of warm-up.
        while len(times) < args.steps:
            if timed_from is None and step >= args.warmup:
                settled = runtime is None or runtime.plan_settled
                if settled or step >= args.max_warmup:
                    timed_from = step
                    result["warmup_steps"] = step
            shape = (2 * args.pairs, args.seq)
            ids = torch.randint(0, DIMS["vocab_size"], shape, generator=generator).cuda()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            begin = time.perf_counter()
            with torch.no_grad():
                ref = sequence_logps(reference, ids)
            torch.cuda.synchronize()
            ref_done = time.perf_counter()
            ratios = (sequence_logps(policy, ids) - ref).view(args.pairs, 2)
            loss = -F.logsigmoid(BETA * (ratios[:, 0] - ratios[:, 1])).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - begin
            if timed_from is not None:
                times.append(elapsed)
                ref_times.append(ref_done - begin)
                peaks.append(torch.cuda.max_memory_allocated())
                reserved.append(torch.cuda.max_memory_reserved())
            print(f"[{name}] step {step}: {elapsed:.2f} s", file=sys.stderr, flush=True)
            step += 1
        step_s = sorted(times)[len(times) // 2]
        result.update(
            step_ms=step_s * 1e3,
            reference_ms=sorted(ref_times)[len(ref_times) // 2] * 1e3,
            pairs_per_s=args.pairs / step_s,
            tokens_per_s=2 * args.pairs * args.seq / step_s,
            peak_allocated_gib=max(peaks) / GIB,
            peak_reserved_gib=max(reserved) / GIB,
            losses=losses,
        )
        if runtime is not None:
            plan = runtime.plan
            result["plan"] = plan.summary()
            if plan.predicted_peak_bytes is not None:
                result["predicted_peak_gib"] = plan.predicted_peak_bytes / GIB
            if plan.predicted_step_s is not None:
                result["predicted_step_ms"] = plan.predicted_step_s * 1e3
    except torch.OutOfMemoryError as error:
        result["oom"] = str(error).splitlines()[0][:200]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", default="24GiB")
    parser.add_argument("--shape", choices=("3b", "8b"), default="3b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--max-warmup", type=int, default=14)
    parser.add_argument(
        "--peers", default="plain,plain@cap,autooffload@cap,autooffload[offload_frozen=0]@cap"
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ["DPO_SHAPE"] = args.shape
    if args.layers is None:
        args.layers = dims()["num_hidden_layers"]
    if args.peer:
        print("RESULT " + json.dumps(peer(args)), flush=True)
        return
    results = []
    for name in args.peers.split(","):
        keys = ("shape", "cap", "layers", "pairs", "seq", "steps", "warmup", "max_warmup")
        result, stderr = run_peer(__file__, name, args, keys)
        result["log"] = [ln for ln in stderr.splitlines() if "[autooffload]" in ln][:12]
        results.append(result)
        progress = [ln for ln in stderr.splitlines() if ln.startswith(f"[{name}]")]
        sys.stderr.write("\n".join(progress[:2] + progress[-2:]) + "\n")
        print(json.dumps({k: v for k, v in result.items() if k != "losses"}), flush=True)
    report = {
        "dims": {**dims(), "num_hidden_layers": args.layers},
        "pairs": args.pairs,
        "seq": args.seq,
        "cap": args.cap,
        "results": results,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    plain = next((r for r in results if r["peer"] == "plain" and "step_ms" in r), None)
    print(
        "| peer | step ms (pred) | reference ms | tokens/s | x plain | peak alloc / reserved GiB"
        " | pred peak GiB |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if "step_ms" not in r:
            print(f"| {r['peer']} | OOM / error: {r.get('oom') or r.get('error', '')[-120:]} |")
            continue
        pred_step = f" ({r['predicted_step_ms']:.0f})" if "predicted_step_ms" in r else ""
        pred = f"{r['predicted_peak_gib']:.2f}" if "predicted_peak_gib" in r else "-"
        ratio = f"{r['tokens_per_s'] / plain['tokens_per_s']:.2f}x" if plain else "-"
        print(
            f"| {r['peer']} | {r['step_ms']:.0f}{pred_step} | {r['reference_ms']:.0f} |"
            f" {r['tokens_per_s']:,.0f} | {ratio} | {r['peak_allocated_gib']:.2f} /"
            f" {r['peak_reserved_gib']:.2f} | {pred} |"
        )


if __name__ == "__main__":
    main()
