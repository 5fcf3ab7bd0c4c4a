"""Preference tuning (DPO) of a random-init Llama with TRL's DPOTrainer and a frozen reference
model, under autooffload.

    python examples/trl_dpo.py                       # tiny models, CPU, seconds
    python examples/trl_dpo.py --size 1b --steps 20  # TinyLlama-1.1B dimensions, on a GPU

The policy trains attached; the reference (a frozen copy of the policy, as scripts pass it to
``DPOTrainer(ref_model=...)``) attaches too when it is large (``AUTOOFFLOAD_OFFLOAD_FROZEN``) and
streams its weights through the GPU in each forward, so the policy's plan keeps the GPU. The data
is ``examples/data/preferences.jsonl`` in TRL's conversational preference format (``prompt``,
``chosen``, ``rejected``); the tokenizer is the Qwen3 one in ``tests/data/tokenizers/qwen3``;
nothing is downloaded.
"""

from __future__ import annotations

import copy
import tempfile

import torch
from _shared import chat_arguments, chat_model, print_losses_and_plan, read_jsonl
from datasets import Dataset
from transformers import AutoTokenizer
from trl import DPOConfig, DPOTrainer

import autooffload
from autooffload import runtime as rt

autooffload.enable()


def main() -> None:
    parser = chat_arguments(__doc__.splitlines()[0], data="preferences.jsonl", steps=4)
    parser.add_argument("--beta", type=float, default=0.1)
    args = parser.parse_args()

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    train_dataset = Dataset.from_list(read_jsonl(args.data))

    model = chat_model(tokenizer, args.size)
    reference = copy.deepcopy(model).requires_grad_(False).eval()

    with tempfile.TemporaryDirectory() as scratch:
        dpo_config = DPOConfig(
            output_dir=scratch,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch_size,
            learning_rate=args.lr,
            beta=args.beta,
            max_length=256,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            bf16=torch.cuda.is_available(),
            disable_tqdm=True,
        )
        trainer = DPOTrainer(
            model=model,
            ref_model=reference,
            args=dpo_config,
            train_dataset=train_dataset,
            processing_class=tokenizer,
        )
        print(
            f"policy attached: {rt.runtime_of(trainer.model) is not None};"
            f" reference attached: {rt.runtime_of(trainer.ref_model) is not None}"
        )
        trainer.train()

    print_losses_and_plan(trainer)


if __name__ == "__main__":
    main()
