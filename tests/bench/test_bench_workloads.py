"""Workload shapes are the real models' and the tiny variants build and train on the CPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from autooffload.bench.models import _config, accepted_batch, build_model, make_batch
from autooffload.bench.workloads import WORKLOADS, get_workload


@pytest.mark.parametrize(
    ("name", "billions"),
    [
        ("llama-1b-full", 1.10),
        ("llama-3b-full", 3.21),
        ("llama-3.6b-full", 3.61),
        ("llama-8b-lora", 8.03),
        ("llama-14b-lora", 14.77),
        ("llama-27b-lora", 27.15),
        ("llama-32b-qlora", 32.5),
        ("qwen2vl-7b-lora", 8.29),
    ],
)
def test_shapes_match_the_named_models(name: str, billions: float) -> None:
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, Qwen2VLForConditionalGeneration

    workload = get_workload(name)
    cls = Qwen2VLForConditionalGeneration if workload.arch == "qwen2vl" else AutoModelForCausalLM
    with init_empty_weights(include_buffers=False):
        model = (
            cls._from_config(_config(workload))
            if workload.arch == "qwen2vl"
            else cls.from_config(_config(workload))
        )
    if workload.text_dims["tie_word_embeddings"]:
        model.tie_weights()  # as build_model does
    params = sum(p.numel() for p in model.parameters())
    assert params / 1e9 == pytest.approx(billions, rel=0.03)
    assert workload.approx_params() / 1e9 == pytest.approx(billions, rel=0.05)


def test_overrides_and_batch_shapes() -> None:
    w = get_workload("llama-8b-lora", bs=1, seq=256, gc=False)
    assert (w.bs, w.seq, w.gc) == (1, 256, False)
    batch = make_batch(w)
    assert batch["input_ids"].shape == (1, 256)
    vlm = make_batch(get_workload("qwen2vl-7b-lora"))
    assert vlm["input_ids"].shape == (4, 1024)
    assert vlm["pixel_values"].shape == (4 * 32 * 32, 3 * 2 * 14 * 14)
    assert (vlm["input_ids"] == 151655).sum() == 4 * 256  # 448 px -> 256 merged image tokens
    assert vlm["image_grid_thw"].tolist() == [[1, 32, 32]] * 4


TINY = [n for n, w in WORKLOADS.items() if w.cpu_only]


@pytest.mark.parametrize("name", TINY)
def test_tiny_workloads_train_on_cpu(name: str) -> None:
    workload = get_workload(name)
    if workload.mode == "qlora" and importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes not installed")
    model = build_model(workload, seed=0)
    again = build_model(workload, seed=0)
    for a, b in zip(model.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)  # same seed, same model: peers are comparable
    batch = accepted_batch(model, make_batch(workload))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=workload.lr)
    losses = []
    for _ in range(3):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    if workload.mode == "qlora":
        import bitsandbytes as bnb

        assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())


@pytest.mark.parametrize("name", ["llama-tiny", "llama-tiny-lora"])
def test_the_parameter_list_is_the_built_models(name: str) -> None:
    """What the host-memory estimate reads without building the model is what is built."""
    workload = get_workload(name)
    built = [
        (p.numel(), p.requires_grad, p.element_size()) for p in build_model(workload).parameters()
    ]
    listed = [(t.numel, t.trainable, t.element_size) for t in workload.parameter_tensors()]
    assert listed == built
    assert get_workload("qwen2vl-tiny-lora").parameter_tensors() is None
    assert get_workload("llama-tiny-qlora").parameter_tensors() is None
    full = get_workload("llama-8b-full").parameter_tensors()
    assert sum(t.numel for t in full) == pytest.approx(
        get_workload("llama-8b-full").approx_params(), rel=1e-5
    )


def test_the_depth_override_builds_that_many_blocks() -> None:
    """``--layers``: the same shape with fewer blocks, rebuilt alike in the worker process."""
    from autooffload.bench.workloads import workload_overrides

    shallow = get_workload("llama-tiny", bs=1, seq=16, layers=3)
    assert shallow.text_dims["num_hidden_layers"] == 3
    assert get_workload("llama-tiny").text_dims["num_hidden_layers"] == 2  # the named one kept
    model = build_model(shallow, seed=0)
    assert len(model.model.layers) == 3
    listed = [(t.numel, t.trainable, t.element_size) for t in shallow.parameter_tensors()]
    assert listed == [(p.numel(), p.requires_grad, p.element_size()) for p in model.parameters()]
    assert "llama-tiny 3 layers:" in shallow.describe()
    assert "layers" not in get_workload("llama-tiny").describe()
    assert get_workload(shallow.name, **workload_overrides(shallow)) == shallow
    with pytest.raises(ValueError, match="invalid layers 0"):
        get_workload("llama-tiny", layers=0)
