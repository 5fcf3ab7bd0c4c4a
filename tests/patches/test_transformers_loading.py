"""from_pretrained(device_map=<one device>) loads on the host and attaches instead of copying."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import autooffload
from autooffload import runtime as rt
from autooffload.patches.transformers_loading import placement_device, single_device


@pytest.fixture
def saved_llama(tmp_path):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path)
    return model, tmp_path


@pytest.mark.parametrize(
    ("device_map", "expected"),
    [
        ("cuda", torch.device("cuda")),
        ("cuda:1", torch.device("cuda", 1)),
        (0, torch.device("cuda", 0)),
        ({"": "cpu"}, torch.device("cpu")),
        ("auto", None),
        ({"model": 0, "lm_head": "cpu"}, None),
        (None, None),
    ],
)
def test_single_device_maps(device_map, expected):
    assert single_device(device_map) == expected


@pytest.mark.parametrize(
    ("device_map", "attach_type", "gpus", "expected"),
    [
        ("auto", "cuda", 1, torch.device("cuda", 0)),
        ("balanced", "cuda", 1, torch.device("cuda", 0)),
        ("auto", "cuda", 2, None),  # several GPUs to spread over: accelerate's
        ("auto", "cpu", 0, torch.device("cpu")),
        ("cuda:1", "cuda", 2, torch.device("cuda", 1)),
        ("cpu", "cuda", 1, None),  # not the attach device
        (None, "cuda", 1, None),
    ],
)
def test_placement_devices(monkeypatch, device_map, attach_type, gpus, expected):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert placement_device(device_map, attach_type) == expected


def test_device_map_on_the_attach_device_attaches_with_the_saved_weights(saved_llama):
    reference, path = saved_llama
    autooffload.enable(device="cpu", force_attach=True, n_persist=0)
    model = AutoModelForCausalLM.from_pretrained(path, device_map="cpu")
    runtime = rt.runtime_of(model)
    assert runtime is not None, "the model was loaded without being attached"
    assert runtime.manager.persistent == set()
    ids = torch.randint(0, 128, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_device_map_auto_is_left_to_accelerate(saved_llama):
    _, path = saved_llama
    autooffload.enable(device="cpu", force_attach=True)
    model = AutoModelForCausalLM.from_pretrained(
        path, device_map={"model": "cpu", "lm_head": "cpu"}
    )
    assert rt.runtime_of(model) is None


def test_disable_restores_from_pretrained(saved_llama):
    from transformers.modeling_utils import PreTrainedModel

    original = PreTrainedModel.__dict__["from_pretrained"]
    autooffload.enable(device="cpu")
    assert PreTrainedModel.__dict__["from_pretrained"] is not original
    autooffload.disable()
    assert PreTrainedModel.__dict__["from_pretrained"] is original
