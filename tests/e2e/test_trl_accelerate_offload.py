"""TRL's SFTTrainer and an accelerate loop run unchanged on an attached model (CPU simulation):
SFT learns and its checkpoints reload into a plain model; the accelerate loop (gradient
accumulation, clipping) trains exactly like the same loop without autooffload."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from datasets import Dataset
from sft_runs import assert_last_checkpoint_reloads, cpu_sft_config
from test_examples import run, trainer_losses
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from trl import SFTTrainer

import autooffload
from autooffload import runtime as rt

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SFT_STEPS = 6
VOCAB = 128
SEQ = 16
# The attached and plain accelerate runs do the same fp32 math except the clip norm's summation
# order (norm of the device-part and host-part norms instead of one norm over every tensor): the
# coefficient differs by an ulp and AdamW's update carries that to ~5e-7 in the weights after
# four steps. A lost micro-batch, or a step taken or skipped wrongly, moves weights by ~lr = 1e-2.
RTOL = 1e-5
ATOL = 1e-5


@pytest.fixture(autouse=True)
def _clean_state():
    yield
    autooffload.disable()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def tiny_config(tokenizer, hidden: int, tied: bool) -> LlamaConfig:
    """A 2-layer Llama over the tokenizer's vocabulary."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )


def chat_dataset() -> Dataset:
    with open(REPO / "examples/data/chat.jsonl") as lines:
        return Dataset.from_list([json.loads(line) for line in lines if line.strip()])


def test_sft_trainer_learns_attached_and_its_checkpoint_reloads_into_a_plain_model(
    tmp_path: Path,
) -> None:
    # n_persist=0: every chunk is offloaded, the (tied) LM head's included, which TRL's fused
    # LM head reads outside the head's forward and again in its backward.
    autooffload.enable(
        device="cpu", force_attach=True, chunk_size=200_000, n_persist=0, log="warning"
    )
    tokenizer = AutoTokenizer.from_pretrained(REPO / "tests/data/tokenizers/qwen3")
    torch.manual_seed(0)
    config = tiny_config(tokenizer, hidden=32, tied=True)
    args = cpu_sft_config(tmp_path, SFT_STEPS, per_device_train_batch_size=8, max_length=128)
    trainer = SFTTrainer(
        model=LlamaForCausalLM(config),
        args=args,
        train_dataset=chat_dataset(),
        processing_class=tokenizer,
    )
    model = trainer.model
    runtime = rt.runtime_of(model)
    assert runtime is not None, "the SFTTrainer's move to cpu did not attach the model"
    assert autooffload.last_plan() is not None
    assert runtime.is_offloaded(model.lm_head.weight)

    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == SFT_STEPS and all(math.isfinite(loss) for loss in losses), losses
    # ln(151k) = 11.9 at the start; six steps on the repeated chat data take it down ~0.45.
    assert losses[-1] < losses[0] - 0.2, losses

    ids = tokenizer("What is the capital of France?", return_tensors="pt")["input_ids"]
    assert_last_checkpoint_reloads(model, tmp_path, SFT_STEPS, LlamaForCausalLM, {"input_ids": ids})


def sft_by_name_quantized(tmp_path: Path, checkpoint: Path, attached: bool) -> tuple[list, bool]:
    """``SFTTrainer(model="<name>", quantization_config=..., peft_config=...)``: TRL loads the
    model itself (``device_map="auto"`` on a GPU, none on the CPU; bitsandbytes then places it on
    the current device). Its losses, and whether the model it trained was attached."""
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    if attached:  # masking off: the plain run trains on every token
        autooffload.enable(device="cpu", force_attach=True, n_persist=0, mask=False, log="warning")
    tokenizer = AutoTokenizer.from_pretrained(REPO / "tests/data/tokenizers/qwen3")
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    args = cpu_sft_config(
        tmp_path,
        4,
        per_device_train_batch_size=8,
        max_length=128,
        save_strategy="no",
        model_init_kwargs={"dtype": "float32"},
    )
    torch.manual_seed(0)
    trainer = SFTTrainer(
        model=str(checkpoint),
        args=args,
        train_dataset=chat_dataset(),
        processing_class=tokenizer,
        quantization_config=quant,
        peft_config=LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )
    is_attached = rt.runtime_of(trainer.model.get_base_model()) is not None
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    autooffload.disable()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return losses, is_attached


def test_sft_trainer_given_a_name_loads_quantized_attached_and_trains_like_plain(
    tmp_path: Path,
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(REPO / "tests/data/tokenizers/qwen3")
    torch.manual_seed(0)
    config = tiny_config(tokenizer, hidden=64, tied=False)
    checkpoint = tmp_path / "checkpoint"
    LlamaForCausalLM(config).save_pretrained(checkpoint)
    expected, plain_attached = sft_by_name_quantized(tmp_path / "plain", checkpoint, False)
    actual, attached = sft_by_name_quantized(tmp_path / "attached", checkpoint, True)
    assert not plain_attached and attached, "TRL's own from_pretrained did not attach the model"
    assert len(actual) == 4 and all(math.isfinite(loss) for loss in actual), actual
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), rtol=RTOL, atol=ATOL)


def test_trl_sft_example_through_the_launcher_attached_in_cpu_simulation() -> None:
    stdout = run(
        "-m",
        "autooffload",
        "examples/trl_sft.py",
        "--steps",
        "3",
        env={"AUTOOFFLOAD_FORCE_ATTACH": "1", "AUTOOFFLOAD_DEVICE": "cpu"},
    )
    assert re.search(r"^plan \((search|user\+search)\): \d+ chunks", stdout, flags=re.M), stdout
    losses = trainer_losses(stdout)
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses), losses


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def accelerate_run(
    attached: bool,
) -> tuple[list[float], list[float], dict[str, torch.Tensor], dict]:
    """Eight micro-batches, two per optimizer step, clipped: (losses, grad norms, final weights,
    optimizer state_dict); ``attached``: whether ``prepare`` must attach the model."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, VOCAB, (SEQ,), generator=generator) for _ in range(16)]
    loader = torch.utils.data.DataLoader(rows, batch_size=2, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    runtime = rt.runtime_of(model)
    if attached:
        assert runtime is not None, "accelerator.prepare did not attach the model"
        assert runtime.plan.n_chunks > runtime.plan.n_persist, "nothing is offloaded"
    else:
        assert runtime is None
    losses, norms = [], []
    model.train()
    for input_ids in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=input_ids, labels=input_ids).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.5)))
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, norms, weights, optimizer.state_dict()


def test_accelerate_loop_with_accumulation_and_clipping_trains_like_the_plain_loop() -> None:
    plain_losses, plain_norms, plain_weights, plain_optimizer_state = accelerate_run(attached=False)
    autooffload.enable(
        device="cpu", force_attach=True, chunk_size=20_000, n_persist=1, mask=False, log="warning"
    )
    losses, norms, weights, optimizer_state = accelerate_run(attached=True)

    assert len(losses) == 8 and len(norms) == 4
    assert losses == pytest.approx(plain_losses, rel=RTOL, abs=ATOL)
    assert norms == pytest.approx(plain_norms, rel=RTOL, abs=ATOL)
    # Four optimizer steps for every param, the offloaded ones' (CPU) state included.
    steps = {float(state["step"]) for state in optimizer_state["state"].values()}
    assert optimizer_state["state"].keys() == plain_optimizer_state["state"].keys()
    assert steps == {4.0}, steps
    assert weights.keys() == plain_weights.keys()
    for name, value in plain_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=RTOL, atol=ATOL, msg=name)
