"""Adapter-only checkpoints of an attached PeftModel: ``save_pretrained`` then
``PeftModel.from_pretrained`` on a fresh base (attached, or not) gives the same outputs."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from peft import PeftModel

import autooffload
from tests.peft.peft_runs import batches, enable_cpu, lora, runtime_for, tiny_llama, train, wrap


@pytest.mark.parametrize("load_attached", [False, True], ids=["load_plain", "load_attached"])
def test_save_pretrained_then_from_pretrained_on_a_fresh_base(tmp_path: Path, load_attached):
    base, data = tiny_llama(), batches(6)
    ids = data[0]
    model = wrap(copy.deepcopy(base), lora(use_dora=True), "peft_then_move", "resident")
    train(model, data[1:])
    with torch.no_grad():
        expected = model(input_ids=ids).logits.clone()
    model.save_pretrained(tmp_path)
    saved = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    autooffload.disable()
    assert (tmp_path / "adapter_model.safetensors").exists()

    if load_attached:
        enable_cpu()
    loaded = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path, is_trainable=True)
    if load_attached:
        loaded.to("cpu")
        assert runtime_for(loaded) is not None
    for name, param in loaded.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(param, saved[name], rtol=0, atol=0, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=0, atol=0)
