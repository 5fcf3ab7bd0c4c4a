"""Train a random-init Llama with a plain PyTorch loop; autooffload is the one line after imports.

    python examples/plain_torch.py                       # tiny model, CPU, seconds
    python examples/plain_torch.py --size 1b --steps 20  # TinyLlama-1.1B dimensions, on a GPU
    python examples/plain_torch.py --save out/           # save_pretrained at the end

Nothing is downloaded: the model is built from a ``transformers.LlamaConfig``. The batch is a
fixed set of random tokens, so the loss falls as the model memorizes it.
"""

from __future__ import annotations

import argparse

import torch
from _shared import CHAT_SIZES, dump_logits
from transformers import AutoModelForCausalLM, LlamaConfig

import autooffload

autooffload.enable()

# The chat examples' shapes with their own vocabularies (TinyLlama's, Llama 3's): no tokenizer
# here, random token ids.
SIZES = {
    name: {**CHAT_SIZES[name], **extra}
    for name, extra in {
        "tiny": dict(vocab_size=1024, max_position_embeddings=512),
        "1b": dict(vocab_size=32000, max_position_embeddings=2048),
        "3b": dict(vocab_size=128256, max_position_embeddings=8192),
    }.items()
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--save", default=None, help="save_pretrained the model here at the end")
    parser.add_argument("--dump-logits", default=None, help="save logits of a fixed batch here")
    args = parser.parse_args()

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = LlamaConfig(**SIZES[args.size])
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.size} Llama, {n_params / 1e6:.1f}M parameters, {dtype}, on {device}")

    tokens = torch.randint(config.vocab_size, (args.batch_size, args.seq_len), device=device)
    for step in range(1, args.steps + 1):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}/{args.steps} loss {loss.item():.4f}", flush=True)

    if args.save is not None:
        model.save_pretrained(args.save)
    if args.dump_logits is not None:
        dump_logits(model, tokens[0].tolist(), args.dump_logits)

    plan = autooffload.last_plan()
    print(plan.summary() if plan is not None else "plan: none (the model was not attached)")


if __name__ == "__main__":
    main()
