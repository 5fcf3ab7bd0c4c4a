"""PEFT tuners other than LoRA on an attached model: trainable tokens (``trainable_token_indices``,
which reads the base embedding without calling its forward), IA3, LoHa, LoKr, VeRA and OFT train
like plain PEFT, and ``merge_and_unload()`` (which reads and writes base weights outside any
block) gives plain's merged model, attached and after detach."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from peft import IA3Config, LoHaConfig, LoKrConfig, OFTConfig, PeftConfig, VeraConfig

import autooffload
from tests.peft.peft_runs import (
    Run,
    assert_same_training,
    batches,
    lora,
    tiny_llama,
    train,
    trained_weights,
    wrap,
)
from tests.peft.test_peft_paths import MERGE_ATOL, MERGE_RTOL

STEPS = 4
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TUNERS: dict[str, Callable[[], PeftConfig]] = {
    "trainable_tokens": lambda: lora(trainable_token_indices=[1, 2, 3]),
    "ia3": lambda: IA3Config(
        target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]
    ),
    "loha": lambda: LoHaConfig(r=4, target_modules=[*LINEAR, "lm_head"]),
    "lokr": lambda: LoKrConfig(r=4, target_modules=LINEAR),
    "vera": lambda: VeraConfig(r=8, target_modules=["q_proj", "v_proj"]),
    "oft": lambda: OFTConfig(r=0, oft_block_size=8, target_modules=["q_proj", "v_proj"]),
}


def _train_and_merge(
    base: torch.nn.Module, config: PeftConfig, order: str, size: str, data: list[torch.Tensor]
) -> tuple[Run, list[torch.Tensor]]:
    model = wrap(copy.deepcopy(base), config, order, size)
    losses = train(model, data)
    with torch.no_grad():
        unmerged = model(input_ids=data[0]).logits.clone()
        merged_model = model.merge_and_unload()
        merged = merged_model(input_ids=data[0]).logits.clone()
        autooffload.disable()
        weights = trained_weights(model)
        detached = merged_model(input_ids=data[0]).logits.clone()
    return Run(losses, weights), [unmerged, merged, detached]


@pytest.mark.parametrize(
    ("tuner", "order", "size"),
    [
        ("trainable_tokens", "peft_then_move", "resident"),
        ("trainable_tokens", "move_then_peft", "resident"),
        ("trainable_tokens", "peft_then_move", "chunked"),
        ("ia3", "peft_then_move", "resident"),
        ("ia3", "move_then_peft", "chunked"),
        ("loha", "peft_then_move", "resident"),
        ("lokr", "move_then_peft", "resident"),
        ("vera", "peft_then_move", "resident"),
        ("oft", "peft_then_move", "resident"),
    ],
)
def test_tuner_trains_and_merges_like_plain_peft(tuner, order, size):
    base, data = tiny_llama(size), batches(STEPS)
    plain, plain_logits = _train_and_merge(base, TUNERS[tuner](), "plain", size, data)
    attached, logits = _train_and_merge(base, TUNERS[tuner](), order, size, data)
    assert_same_training(plain, attached)
    for name, expected, actual in zip(("unmerged", "merged", "detached"), plain_logits, logits):
        torch.testing.assert_close(actual, expected, rtol=MERGE_RTOL, atol=MERGE_ATOL, msg=name)
