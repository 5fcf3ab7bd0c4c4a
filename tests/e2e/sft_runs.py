"""What the TRL end-to-end tests share: the ``SFTConfig`` (a few fp32 steps on the CPU, clipped,
logged every step, checkpointed every third) and the check that the last checkpoint reloads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from trl import SFTConfig

import autooffload
from autooffload import runtime as rt


def cpu_sft_config(output_dir: Path, max_steps: int, **overrides: Any) -> SFTConfig:
    """fp32 SFT on the CPU: TRL defaults to bf16, which autocasts the forward even on CPU, and
    fp32 keeps the trained model's logits comparable bit for bit with a plain model's."""
    settings: dict[str, Any] = dict(
        output_dir=str(output_dir),
        max_steps=max_steps,
        learning_rate=3e-3,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="steps",
        save_steps=3,
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=0,
        disable_tqdm=True,
    )
    return SFTConfig(**{**settings, **overrides})


def assert_last_checkpoint_reloads(
    model: torch.nn.Module, output_dir: Path, steps: int, model_class: Any, inputs: dict
) -> tuple[torch.nn.Module, torch.Tensor]:
    """After ``steps`` SFT steps with ``save_steps=3``: ``disable()`` the attached ``model``, load
    the last checkpoint as a plain ``model_class``, and check it has the attached model's weights
    and, on ``inputs``, its logits exactly (the same fp32 weights through the same kernels).
    Returns the plain model and its logits."""
    model.eval()
    with torch.no_grad():
        attached_logits = model(**inputs).logits
    attached_weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    autooffload.disable()
    checkpoint = output_dir / f"checkpoint-{steps}"
    assert (output_dir / "checkpoint-3").is_dir() and checkpoint.is_dir()
    plain = model_class.from_pretrained(checkpoint)
    assert rt.runtime_of(plain) is None
    plain_weights = plain.state_dict()
    assert plain_weights.keys() == attached_weights.keys()
    for name, value in attached_weights.items():
        assert torch.equal(plain_weights[name], value), name
    with torch.no_grad():
        plain_logits = plain(**inputs).logits
    torch.testing.assert_close(plain_logits, attached_logits, rtol=0, atol=0)
    return plain, plain_logits
