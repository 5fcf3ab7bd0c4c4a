"""QLoRA the way scripts write it, under a GPU memory cap: plain transformers vs autooffload.

    python benchmarks/qlora_from_pretrained.py --cap 4GiB --out qlora.json

Saves a random-init Llama-3.2-3B-shaped checkpoint in bf16 (from a config: nothing is
downloaded), then runs one unchanged QLoRA script per peer, each in its own process:
``from_pretrained(quantization_config=nf4 + double quant, bf16 compute)`` with no device_map,
``prepare_model_for_kbit_training`` (HF gradient checkpointing), ``get_peft_model`` (LoRA r=16 on
every linear), fused AdamW, ``--steps`` timed steps after ``--warmup``. Peers:

* ``plain``: no autooffload, no cap (the reference speed and memory);
* ``plain@cap``: no autooffload, ``torch.cuda.set_per_process_memory_fraction`` at the cap;
* ``autooffload@cap``: ``autooffload.enable(budget=cap)`` and the same fraction, so a plan that
  overshoots really runs out of memory.

Reported per peer: load seconds (bitsandbytes on the GPU for plain, on the host under
autooffload), step ms, tokens/s, peak allocated and reserved GiB, and for autooffload the
plan's predicted peak. ``OOM`` where the peer ran out of memory (at load or in training).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from peer_processes import LLAMA_3B, parse_bytes, run_peer

GIB = 1 << 30
DIMS = LLAMA_3B


def save_checkpoint(path: Path, layers: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return
    config = LlamaConfig(**{**DIMS, "num_hidden_layers": layers})
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, 0.02, generator=generator)
    model.save_pretrained(path)


def peer(args: argparse.Namespace) -> dict:
    """One peer, in this process: load, prepare, train; its figures."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    import autooffload

    name = args.peer
    cap = parse_bytes(args.cap) if "@cap" in name else None
    if cap is not None:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(cap / total)
    if name.startswith("autooffload"):
        autooffload.enable(budget=cap, log="info")
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    result: dict = {"peer": name, "cap_gib": cap / GIB if cap else None}
    try:
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(
            args.checkpoint, quantization_config=quant, dtype=torch.bfloat16
        )
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
        result["load_s"] = time.perf_counter() - start
        config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)
        model = get_peft_model(model, config)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
        generator = torch.Generator().manual_seed(0)
        times, losses = [], []
        for step in range(args.warmup + args.steps):
            ids = torch.randint(0, DIMS["vocab_size"], (args.batch, args.seq), generator=generator)
            ids = ids.cuda()
            torch.cuda.synchronize()
            begin = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            torch.cuda.synchronize()
            if step >= args.warmup:
                times.append(time.perf_counter() - begin)
            if step == args.warmup - 1:
                torch.cuda.reset_peak_memory_stats()
        step_s = sorted(times)[len(times) // 2]
        result.update(
            step_ms=step_s * 1e3,
            tokens_per_s=args.batch * args.seq / step_s,
            peak_allocated_gib=torch.cuda.max_memory_allocated() / GIB,
            peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB,
            losses=losses,
            trainable_params=sum(p.numel() for p in params),
        )
        plan = autooffload.last_plan()
        if plan is not None:
            result["plan"] = plan.summary()
            if plan.predicted_peak_bytes is not None:
                result["predicted_peak_gib"] = plan.predicted_peak_bytes / GIB
    except torch.OutOfMemoryError as error:
        result["oom"] = str(error).splitlines()[0][:200]
        plan = autooffload.last_plan()
        if plan is not None:
            result["plan"] = plan.summary()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", default="4GiB")
    parser.add_argument("--layers", type=int, default=DIMS["num_hidden_layers"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--checkpoint", type=Path, default=Path("/tmp/autooffload-qlora-ckpt"))
    parser.add_argument("--peers", default="plain,plain@cap,autooffload@cap")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer:
        print("RESULT " + json.dumps(peer(args)), flush=True)
        return
    start = time.perf_counter()
    save_checkpoint(args.checkpoint, args.layers)
    print(f"checkpoint at {args.checkpoint} ({time.perf_counter() - start:.1f} s)", flush=True)
    results = []
    for name in args.peers.split(","):
        keys = ("cap", "layers", "batch", "seq", "steps", "warmup", "checkpoint")
        result, _ = run_peer(__file__, name, args, keys)
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "losses"}), flush=True)
    report = {
        "dims": {**DIMS, "num_hidden_layers": args.layers},
        "batch": args.batch,
        "seq": args.seq,
        "cap": args.cap,
        "results": results,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    print("| peer | load s | step ms | tok/s | peak alloc GiB | peak reserved GiB | pred peak |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if "step_ms" not in r:
            print(f"| {r['peer']} | OOM / error: {r.get('oom') or r.get('error', '')[-120:]} |")
            continue
        pred = f"{r['predicted_peak_gib']:.2f}" if "predicted_peak_gib" in r else "-"
        print(
            f"| {r['peer']} | {r['load_s']:.1f} | {r['step_ms']:.0f} | {r['tokens_per_s']:,.0f} |"
            f" {r['peak_allocated_gib']:.2f} | {r['peak_reserved_gib']:.2f} | {pred} |"
        )


if __name__ == "__main__":
    main()
