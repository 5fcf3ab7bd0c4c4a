"""TRL's DPOTrainer on attached models (CPU simulation): the policy trains attached, the
reference model attaches too and streams (``Settings.offload_frozen``; TRL loads it by name with
its params requiring grad, or the script passes it frozen), and the losses equal a plain run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from datasets import Dataset
from test_trl_accelerate_offload import REPO, _clean_state, tiny_config  # noqa: F401 (autouse)
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
from trl import DPOConfig, DPOTrainer

import autooffload
from autooffload import runtime as rt

pytestmark = pytest.mark.slow

STEPS = 4


def preferences() -> Dataset:
    rows = [
        {
            "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
            "chosen": [{"role": "assistant", "content": f"It is {2 * i}."}],
            "rejected": [{"role": "assistant", "content": f"It is {2 * i + 1}, I think."}],
        }
        for i in range(4 * STEPS)
    ]
    return Dataset.from_list(rows)


def dpo_losses(
    output_dir: Path, checkpoint: Path, attached: bool, frozen_ref: bool
) -> tuple[list[float], dict]:
    """DPO for ``STEPS`` steps; ``frozen_ref``: the script loads the reference and freezes it,
    else TRL loads it by name. Returns the losses and what was attached, and how."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    if attached:
        autooffload.enable(
            device="cpu", force_attach=True, chunk_size=200_000, n_persist=0, log="warning"
        )
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ref_model = None
    if frozen_ref:
        ref_model = AutoModelForCausalLM.from_pretrained(checkpoint).requires_grad_(False)
    config = DPOConfig(
        output_dir=str(output_dir),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=0,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = DPOTrainer(
        model=str(checkpoint),
        ref_model=ref_model,
        args=config,
        train_dataset=preferences(),
        processing_class=tokenizer,
    )
    assert trainer.ref_model is not None
    policy, reference = rt.runtime_of(trainer.model), rt.runtime_of(trainer.ref_model)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    seen = {"policy": policy is not None, "reference": reference is not None}
    if reference is not None:
        staging = reference.manager.grads.staging
        seen.update(
            ref_persistent=reference.plan.n_persist,
            ref_staging_bytes=staging.total_bytes,
            ref_staging_allocated=staging.allocated,
            distinct=policy is not reference,
        )
    autooffload.disable()
    return losses, seen


@pytest.mark.parametrize("frozen_ref", [False, True], ids=["ref-by-name", "ref-frozen"])
def test_dpo_with_a_reference_model_trains_attached_like_plain(
    tmp_path: Path, frozen_ref: bool
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(REPO / "tests/data/tokenizers/qwen3")
    torch.manual_seed(0)
    checkpoint = tmp_path / "checkpoint"
    LlamaForCausalLM(tiny_config(tokenizer, hidden=64, tied=False)).save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    expected, plain = dpo_losses(tmp_path / "plain", checkpoint, False, frozen_ref)
    actual, seen = dpo_losses(tmp_path / "attached", checkpoint, True, frozen_ref)
    assert plain == {"policy": False, "reference": False}
    # The reference never trains: nothing of it on the device between forwards, and its
    # gradient staging never allocated (by name its params require grad; frozen it has none).
    assert (seen.pop("ref_staging_bytes") == 0) is frozen_ref
    assert seen == {
        "policy": True,
        "reference": True,
        "ref_persistent": 0,
        "ref_staging_allocated": False,
        "distinct": True,
    }
    assert len(actual) == STEPS and all(math.isfinite(loss) for loss in actual), actual
    assert expected[-1] < expected[0], expected
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), rtol=1e-5, atol=1e-5)
