"""LoRA on four vision-language architectures, CPU simulation: with every
chunk offloaded, training equals plain PEFT, and the vision tower is chunked, traced and
profiled from the real image batch (never unaccounted)."""

from __future__ import annotations

import copy

import pytest
import torch

import autooffload
from autooffload.bench.models import accepted_batch
from tests.peft.peft_runs import (
    Run,
    adamw,
    assert_same_training,
    lora,
    runtime_for,
    trained_weights,
    wrap,
)
from tests.peft.vlm_models import ARCHS, tiny_vlm, vision_tower, vlm_batch

STEPS = 5


def _train(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> list[float]:
    optimizer = adamw(model)
    losses = []
    for _ in range(STEPS):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_on_a_vlm_with_every_chunk_offloaded_trains_like_plain_peft(arch: str) -> None:
    base = tiny_vlm(arch)
    batch = accepted_batch(base, vlm_batch(arch))
    assert "pixel_values" in batch

    plain = wrap(copy.deepcopy(base), lora(), "plain", "chunked")
    expected = Run(_train(plain, batch), trained_weights(plain))
    assert expected.losses[-1] < expected.losses[0]

    model = wrap(copy.deepcopy(base), lora(), "peft_then_move", "chunked")
    runtime = runtime_for(model)
    tower = vision_tower(model)
    tower_params = list(tower.parameters())
    assert tower_params and all(runtime.owns(p) for p in tower_params), "tower not chunked"
    frozen = [p for p in tower_params if not p.requires_grad]
    assert frozen and all(runtime.is_offloaded(p) for p in frozen)
    losses = _train(model, batch)

    # The tower's blocks are block groups; they ran (in the traced order) and the profile the
    # plan was searched on has them, with the real image batch's activation bytes.
    tower_modules = {id(m) for m in tower.modules()}
    tower_blocks = [g for g in runtime.groups if g.is_block and id(g.module) in tower_modules]
    assert len(tower_blocks) >= 2, [g.name for g in runtime.groups]
    traced = set(runtime.last_trace)
    assert all(g.index in traced for g in tower_blocks)
    profiled = {unit.name: unit for unit in runtime.profile.blocks}
    for group in tower_blocks:
        assert profiled[group.name].act_bytes_checkpoint > 0, group.name
        assert profiled[group.name].act_bytes_keep > 0, group.name
    n_blocks = sum(g.is_block for g in runtime.groups)
    assert len(runtime.profile.blocks) == n_blocks

    autooffload.disable()
    assert_same_training(expected, Run(losses, trained_weights(model)))


def test_llama_vision_decoder_layers_of_two_classes_are_blocks() -> None:
    """Llama-3.2-Vision interleaves self- and cross-attention decoder layers in one list: both
    are blocks (activation policies, per-class profile), not dozens of per-Linear groups."""
    autooffload.enable(device="cpu", force_attach=True, chunk_size=20_000, mask=False)
    model = tiny_vlm("mllama").to("cpu")
    runtime = runtime_for(model)
    layers = model.model.language_model.layers
    assert len({type(layer) for layer in layers}) == 2
    blocks = {id(g.module) for g in runtime.groups if g.is_block}
    assert all(id(layer) in blocks for layer in layers)
    assert not any(g.name.startswith("model.language_model.layers.1.") for g in runtime.groups)
