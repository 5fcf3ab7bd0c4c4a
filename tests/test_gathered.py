"""autooffload.gathered: read and modify offloaded parameters outside a forward."""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import autooffload
from autooffload import runtime as rt


def _tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config)


def test_gathered_reads_offloaded_weights_and_releases_them_after():
    plain = _tiny()
    model = copy.deepcopy(plain)
    autooffload.enable(device="cpu", force_attach=True, n_persist=0)
    model.to("cpu")
    runtime = rt.runtime_of(model)
    weight = model.model.layers[1].mlp.up_proj.weight
    assert runtime.is_offloaded(weight)
    with autooffload.gathered(model.model.layers[1]):
        torch.testing.assert_close(weight, plain.model.layers[1].mlp.up_proj.weight)
    assert weight.untyped_storage().nbytes() == 0, "the chunk stayed resident after the block"


def test_gathered_with_modify_stores_the_change():
    model = _tiny()
    autooffload.enable(device="cpu", force_attach=True, n_persist=0)
    model.to("cpu")
    weight = model.model.layers[0].self_attn.q_proj.weight
    with autooffload.gathered(weight, modify=True):
        weight.data.mul_(0.0)
    with autooffload.gathered(weight):
        assert torch.count_nonzero(weight) == 0
    assert torch.count_nonzero(model.state_dict()["model.layers.0.self_attn.q_proj.weight"]) == 0


def test_gathered_is_a_no_op_for_unattached_params():
    model = _tiny()
    with autooffload.gathered(model):
        assert torch.isfinite(model.lm_head.weight).all()
