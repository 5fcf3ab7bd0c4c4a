"""Train a random-init Llama with a plain PyTorch loop; autooffload is the one line after imports.

    AUTOOFFLOAD_FORCE_ATTACH=1 python examples/plain_torch.py   # tiny model, CPU, seconds
    python examples/plain_torch.py --size 1b --steps 20         # TinyLlama-1.1B shape, on a GPU
    python examples/plain_torch.py --save out/                  # save_pretrained at the end

Nothing is downloaded: the model is built from a ``transformers.LlamaConfig``. The batch is a
fixed set of random tokens, so the loss falls as the model memorizes it.

Without a GPU, autooffload runs its CPU simulation (host memory plays the device), and the
example gives that device half the memory plain training needs (``_cpu_simulation.py``; unless
``AUTOOFFLOAD_BUDGET`` is set), so the plan must stream weights from the host and swap or
recompute activations; then it trains the same model without autooffload and compares the
losses. ``AUTOOFFLOAD_FORCE_ATTACH=1`` attaches the tiny model, which is under the 1 GiB attach
threshold.
"""

from __future__ import annotations

import argparse

import torch
from _cpu_simulation import simulate_small_device, summary
from _shared import CHAT_SIZES, dump_logits
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

import autooffload

autooffload.enable()

# The chat examples' shapes with their own vocabularies (TinyLlama's, Llama 3's): no tokenizer
# here, random token ids.
SIZES = {
    name: {**CHAT_SIZES[name], **extra}
    for name, extra in {
        "tiny": dict(vocab_size=1024, max_position_embeddings=512, num_hidden_layers=4),
        "1b": dict(vocab_size=32000, max_position_embeddings=2048),
        "3b": dict(vocab_size=128256, max_position_embeddings=8192),
    }.items()
}


def build_model(config: LlamaConfig, dtype: torch.dtype) -> PreTrainedModel:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def train(model: PreTrainedModel, tokens: torch.Tensor, args: argparse.Namespace) -> list[float]:
    """The training loop: nothing in it knows about autooffload."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step in range(1, args.steps + 1):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        print(f"step {step}/{args.steps} loss {losses[-1]:.4f}", flush=True)
    return losses


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

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = LlamaConfig(**SIZES[args.size])
    tokens = torch.randint(
        config.vocab_size,
        (args.batch_size, args.seq_len),
        generator=torch.Generator().manual_seed(0),
    ).to(device)

    plain_bytes = None
    if device == "cpu":
        plain_bytes = simulate_small_device(lambda: build_model(config, dtype), tokens)
    model = build_model(config, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.size} Llama, {n_params / 1e6:.2f}M parameters, {dtype}, on {device}")
    model = model.to(device)  # a large model (or any, with FORCE_ATTACH) attaches here
    losses = train(model, tokens, args)
    if args.save is not None:
        model.save_pretrained(args.save)
    if args.dump_logits is not None:
        dump_logits(model, tokens[0].tolist(), args.dump_logits)
    plan = autooffload.last_plan()

    plain = None
    if device == "cpu" and plan is not None:
        print("plain training of the same model, for comparison:")
        autooffload.disable()
        plain = train(build_model(config, dtype), tokens, args)
    print(summary(plan, plain_bytes, losses, plain))


if __name__ == "__main__":
    main()
