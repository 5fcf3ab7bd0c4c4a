"""Collate-time cost of assistant-only masking: 32 chat samples of 4096 tokens, CPU.

Runs the transformers and TRL language-modeling collators on the same pre-tokenized Qwen3 (ChatML)
conversations with autooffload disabled and enabled, and times the masking call alone: on the
same batch over and over (``mask_call_ms``, caches warm) and right after each unpatched collate
(``mask_call_fresh_ms``, as it runs in training). Every timing is interleaved with the others, so
load drift on a shared machine hits all of them; each figure is the fastest of ``--repeats``, with
the median and the 90th percentile as the spread. Writes ``benchmarks/results/masking_collate.json``
(or ``--out``) and prints it.

    python benchmarks/masking_collate.py [--batch 32] [--seq 4096] [--repeats 40] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "masking_collate.json"
WORDS = "the a model trains on answers only while prompts are masked out of every loss".split()


def conversation(rng: random.Random, turns: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    for _ in range(turns):
        for role in ("user", "assistant"):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120)))
            messages.append({"role": role, "content": text})
    return messages


def samples(tokenizer, batch: int, seq: int) -> list[dict[str, list[int]]]:
    rng = random.Random(0)
    out = []
    for _ in range(batch):
        ids: list[int] = []
        while len(ids) < seq:
            text = tokenizer.apply_chat_template(conversation(rng, 12), tokenize=False)
            ids += tokenizer(text, add_special_tokens=False)["input_ids"]
        out.append({"input_ids": ids[: rng.randint(seq - 256, seq)]})  # varied, truncated turns
    return out


def elapsed_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def spread(times: list[float]) -> dict[str, float]:
    """Fastest (the least disturbed run on a shared machine), median and 90th percentile."""
    ordered = sorted(times)
    return {
        "min": round(ordered[0], 3),
        "median": round(ordered[len(ordered) // 2], 3),
        "p90": round(ordered[int(0.9 * (len(ordered) - 1))], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from transformers import AutoTokenizer, DataCollatorForLanguageModeling
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling as TRLCollator

    import autooffload
    from autooffload.masking import MaskerCache, MaskingOptions

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "tests" / "data" / "tokenizers" / "qwen3")
    features = samples(tokenizer, args.batch, args.seq)
    hf = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    trl = TRLCollator(pad_token_id=tokenizer.pad_token_id)
    masker = MaskerCache(MaskingOptions()).get(tokenizer)

    def mask(batch, labels_match_ids=False):
        ids, labels, attention = batch["input_ids"], batch["labels"], batch["attention_mask"]
        return masker.mask(ids, labels, attention, labels_match_ids=labels_match_ids)

    autooffload.enable(device="cpu", offload=False, log="warning")
    from autooffload.patches import hf_collators

    hf_collators._session.bind(trl, tokenizer)  # as the SFTTrainer.__init__ patch does
    times: dict[str, list[float]] = {}
    for _ in range(args.repeats):  # interleaved, so load drift on a shared machine hits all
        for name, collator in (("hf", hf), ("trl", trl)):
            original = type(collator).torch_call.__wrapped__  # the unpatched method
            times.setdefault(f"{name}_off", []).append(
                elapsed_ms(lambda f=original, c=collator: f(c, features))
            )
            times.setdefault(f"{name}_on", []).append(
                elapsed_ms(lambda c=collator: c.torch_call(features))
            )
            batch = original(collator, features)
            # As the collator's patch calls it: TRL's labels are known to be the padded ids.
            match = name == "trl" and hf_collators.trl_labels_match_ids(collator, features)
            times.setdefault(f"{name}_mask_fresh", []).append(
                elapsed_ms(lambda b=batch, m=match: mask(b, m))
            )
            if name == "hf":  # the same batch again: warm caches, as the first version measured
                times.setdefault("mask_hot", []).append(elapsed_ms(lambda b=batch: mask(b)))
    autooffload.disable()

    mask_ms = min(times["mask_hot"])
    results = {"batch": args.batch, "seq": args.seq, "device": "cpu", "threads": 1}
    results["repeats"] = args.repeats
    for name in ("hf", "trl"):
        off, on = min(times[f"{name}_off"]), min(times[f"{name}_on"])
        fresh = min(times[f"{name}_mask_fresh"])
        results[name] = {
            "collate_ms": round(off, 3),
            "collate_masked_ms": round(on, 3),
            "overhead_pct": round(100 * (on - off) / off, 2),
            "mask_call_pct_of_collate": round(100 * mask_ms / off, 2),
            "mask_call_fresh_ms": round(fresh, 3),
            "mask_call_fresh_pct_of_collate": round(100 * fresh / off, 2),
            "spread_ms": {
                "collate": spread(times[f"{name}_off"]),
                "collate_masked": spread(times[f"{name}_on"]),
                "mask_call_fresh": spread(times[f"{name}_mask_fresh"]),
            },
        }
    results["mask_call_ms"] = round(mask_ms, 3)
    results["mask_call_spread_ms"] = spread(times["mask_hot"])
    results["turns_in_batch"] = len(masker.scanner.turns(hf(features)["input_ids"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
