"""Adapter-only checkpoints of an attached PeftModel: ``save_pretrained`` then
``PeftModel.from_pretrained`` on a fresh base (attached, or not) gives the same outputs;
``hotswap_adapter`` of a saved adapter into an attached model."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from peft import PeftModel, get_peft_model
from peft.utils.hotswap import hotswap_adapter
from safetensors.torch import load_file

import autooffload
from autooffload.errors import AttachError
from tests.peft.peft_runs import (
    Run,
    adamw,
    assert_same_training,
    batches,
    enable_cpu,
    lora,
    runtime_for,
    tiny_llama,
    train,
    trained_weights,
    wrap,
)


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


def test_save_pretrained_mid_run_of_adapters_in_chunks_saves_plain_bytes(tmp_path: Path):
    """Adapters over a tenth of the bytes are offloaded in chunks: the checkpoint written
    between steps holds plain PEFT's values, and training goes on unchanged after it."""
    base, data = tiny_llama("chunked"), batches(6)
    runs = []
    for kind in ("plain", "attached"):
        if kind == "attached":
            enable_cpu("chunked")
        torch.manual_seed(123)
        model = get_peft_model(copy.deepcopy(base), lora(use_dora=True))
        model.to("cpu")
        optimizer = adamw(model)
        losses = []
        for i, ids in enumerate(data):
            if i == 3:
                model.save_pretrained(tmp_path / kind)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        autooffload.disable()
        saved = load_file(tmp_path / kind / "adapter_model.safetensors")
        runs.append((Run(losses, trained_weights(model)), saved))
    (plain, plain_saved), (attached, attached_saved) = runs
    assert_same_training(plain, attached)
    assert attached_saved.keys() == plain_saved.keys()
    for name, tensor in plain_saved.items():
        torch.testing.assert_close(attached_saved[name], tensor, rtol=0, atol=0, msg=name)


def _saved_adapter(base: torch.nn.Module, path: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), lora())
    train(model, batches(2, seed=seed))
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("size", ["resident", "chunked"])
def test_hotswap_adapter_into_an_attached_model(tmp_path: Path, size):
    """``hotswap_adapter`` writes the saved weights into the loaded adapter's params in place:
    on the device that equals plain PEFT; into adapters offloaded in chunks (over a tenth of the
    bytes) it is refused before anything is written."""
    base, data = tiny_llama(size), batches(2)
    first = _saved_adapter(base, tmp_path / "first", 11)
    second = _saved_adapter(base, tmp_path / "second", 12)
    runs = []
    for attached in (False, True):
        if attached:
            enable_cpu(size)
        model = PeftModel.from_pretrained(copy.deepcopy(base), first, is_trainable=True)
        model.to("cpu")
        assert (runtime_for(model) is not None) == attached
        losses = train(model, data)
        if attached and size == "chunked":
            with pytest.raises(AttachError, match="hotswap_adapter into adapter 'default'"):
                hotswap_adapter(model, str(second), adapter_name="default")
            autooffload.disable()
            return
        hotswap_adapter(model, str(second), adapter_name="default")
        losses += train(model, data)
        autooffload.disable()
        runs.append(Run(losses, trained_weights(model)))
    assert_same_training(*runs)
