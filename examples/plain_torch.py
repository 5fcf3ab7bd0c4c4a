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
from transformers import AutoModelForCausalLM, LlamaConfig

import autooffload

autooffload.enable()

SIZES = {
    "tiny": dict(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    ),
    # TinyLlama-1.1B
    "1b": dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    ),
    # Llama-3.2-3B
    "3b": dict(
        vocab_size=128256,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
}


def dump_logits(model: torch.nn.Module, input_ids: list[int], path: str) -> None:
    """Save the model's logits on one fixed sequence (under bf16 autocast on a GPU, as every
    example does), to compare with a plain model loaded from the saved checkpoint."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ids = torch.tensor([input_ids], device=device)
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        logits = model(input_ids=ids).logits
    torch.save({"input_ids": ids.cpu(), "logits": logits.float().cpu()}, path)


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
