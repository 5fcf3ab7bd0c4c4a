"""LoRA, DoRA and rsLoRA training with every base chunk offloaded equals plain PEFT training.

20 AdamW steps, same seed and data, fp32 (tolerance: ``peft_runs.RTOL``). Both attach orders:
the PeftModel attaches (``get_peft_model`` then ``.to``), or the base attaches first and PEFT
wraps the attached model (adapters created after attach must land on the device, be trained by
the user's optimizer, and leave the frozen base streaming).
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import EvaConfig, get_peft_model, initialize_lora_eva_weights

import autooffload
from autooffload import runtime as rt
from tests.peft.peft_runs import (
    Run,
    assert_same_training,
    batches,
    enable_cpu,
    lora,
    run,
    runtime_for,
    tiny_llama,
    train,
    trained_weights,
    wrap,
)

VARIANTS = {
    "lora": {},
    "dora": {"use_dora": True},
    "rslora": {"use_rslora": True},
}


@pytest.mark.parametrize("order", ["peft_then_move", "move_then_peft"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_training_with_every_base_chunk_offloaded_matches_plain_peft(variant, order):
    base, data = tiny_llama(), batches()
    config = lora(**VARIANTS[variant])
    plain = run(base, config, "plain", "resident", data)
    offloaded = run(base, config, order, "resident", data)
    assert_same_training(plain, offloaded)
    lora_b = [w for n, w in plain.adapters.items() if "lora_B" in n]
    assert lora_b and all(w.abs().max() > 1e-3 for w in lora_b), "the adapters did not train"


@pytest.mark.parametrize("variant", ["lora", "dora"])
def test_adapters_over_a_tenth_of_the_bytes_train_in_chunks_and_match(variant):
    """On a model where the adapters are ~25% of the bytes they are chunked with the base and
    updated by the CPU optimizer (the full fine-tuning path): still the same training."""
    base, data = tiny_llama("chunked"), batches()
    config = lora(**VARIANTS[variant])
    plain = run(base, config, "plain", "chunked", data)
    model = wrap(copy.deepcopy(base), config, "peft_then_move", "chunked")
    runtime = runtime_for(model)
    assert runtime.resident_params == []
    assert all(runtime.owns(p) for p in model.parameters() if p.requires_grad)
    losses = train(model, data)
    autooffload.disable()
    assert_same_training(plain, Run(losses, trained_weights(model)))


@pytest.mark.parametrize("order", ["peft_then_move", "move_then_peft"])
def test_adapters_stay_on_the_device_and_the_frozen_base_streams_host_to_device_only(order):
    model = wrap(tiny_llama(), lora(use_dora=True), order, "resident")
    runtime = runtime_for(model)
    adapters = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    assert adapters and frozen
    for name, param in adapters:
        assert not runtime.owns(param), f"adapter {name} is in a chunk"
        assert param.device == runtime.device, name
    for name, param in frozen:
        assert runtime.is_offloaded(param), f"base weight {name} does not stream"
    train(model, batches(2))
    stats = runtime.stats()
    assert stats["h2d_bytes"] >= 2 * runtime.layout.total_bytes, "the base did not stream"
    assert stats["d2h_bytes"] == 0, "a frozen weight had a gradient sent to the host"
    assert runtime.cpu_optim.updates == 0, "the CPU optimizer updated a frozen chunk"


def test_adapters_on_lm_head_and_embeddings_outside_the_blocks_match_plain():
    """LoRA/DoRA layers whose base is a group of its own (not a block): DoRA reads the base
    weight after the base forward returned, and adapters of a chunked model are groups too."""
    for size in ("resident", "chunked"):
        base, data = tiny_llama(size, tied=True), batches(6)
        config = lora(use_dora=True, target_modules=["q_proj", "down_proj", "lm_head"])
        plain = run(base, config, "plain", size, data)
        for order in ("peft_then_move", "move_then_peft"):
            assert_same_training(plain, run(base, config, order, size, data))
        embed = lora(target_modules=["embed_tokens", "v_proj"])
        assert_same_training(
            run(base, embed, "plain", size, data), run(base, embed, "peft_then_move", size, data)
        )


def test_peft_injection_never_attaches_the_new_adapter_modules():
    """PEFT moves every new adapter onto its base layer's device with ``.to``; in the CPU
    simulation with ``force_attach`` that move must not attach each little Linear."""
    model = wrap(tiny_llama(), lora(), "peft_then_move", "resident")
    assert [type(r.model).__name__ for r in rt.runtimes()] == ["PeftModel"]
    assert runtime_for(model).model is model
    assert model(input_ids=batches(1)[0]).logits.isfinite().all()


@pytest.mark.parametrize("order", ["peft_then_move", "move_then_peft"])
def test_resident_adapters_optimizer_drives_profiling_to_the_searched_plan(order):
    """The user's optimizer holds only resident adapters (no chunk-owned param): its steps
    must still end the profiling steps, or the run stays on the conservative plan for good
    (everything streamed, every block recomputed)."""
    enable_cpu("resident", n_persist=None)
    base = tiny_llama()
    if order == "move_then_peft":
        base.to("cpu")
    torch.manual_seed(123)
    model = get_peft_model(base, lora())
    model.to("cpu")
    runtime = runtime_for(model)
    assert runtime is not None and runtime.plan.source == "profiling step"
    train(model, batches(4))
    assert runtime.plan.source != "profiling step", runtime.plan.summary()
    assert autooffload.last_plan() is runtime.plan


INIT_VARIANTS = {
    "gaussian": {"init_lora_weights": "gaussian"},
    "pissa": {"init_lora_weights": "pissa"},
    "olora": {"init_lora_weights": "olora"},
    "layers_to_transform": {"target_modules": ["q_proj", "v_proj"], "layers_to_transform": [0, 2]},
}


@pytest.mark.parametrize("variant", list(INIT_VARIANTS))
def test_adapter_init_variants_created_on_an_attached_base_match_plain(variant):
    """PiSSA and OLoRA rewrite the base weight at creation: created after attach, the residual
    must reach the offloaded chunk. Gaussian init and ``layers_to_transform`` pick other
    adapter values and layers."""
    base, data = tiny_llama(), batches(6)
    config = lora(**INIT_VARIANTS[variant])
    plain = run(base, config, "plain", "resident", data)
    assert_same_training(plain, run(base, config, "move_then_peft", "resident", data))


@pytest.mark.parametrize("order", ["peft_then_move", "move_then_peft"])
def test_eva_data_driven_init_matches_plain(order):
    """EVA creates the adapters on ``meta`` and sizes them from activations seen in forwards;
    the adapters it then moves to the base layer's device are no model to attach."""
    base, data = tiny_llama(), batches(4)
    calibration = [{"input_ids": ids} for ids in batches(4, seed=8)]
    runs = []
    for kind in ("plain", order):
        model = copy.deepcopy(base)
        if kind != "plain":
            enable_cpu()
        if kind == "move_then_peft":
            model.to("cpu")
        # EVA writes the ranks it found into the config: a fresh one per run.
        config = lora(
            init_lora_weights="eva",
            eva_config=EvaConfig(rho=2.0),
            target_modules=["q_proj", "v_proj"],
        )
        torch.manual_seed(123)
        peft_model = get_peft_model(model, config, low_cpu_mem_usage=True)
        torch.manual_seed(9)
        initialize_lora_eva_weights(peft_model, calibration, show_progress_bar=False)
        peft_model.to("cpu")
        assert (runtime_for(peft_model) is not None) == (kind != "plain")
        assert [type(r.model).__name__ for r in rt.runtimes()] == (
            []
            if kind == "plain"
            else ["PeftModel" if kind == "peft_then_move" else "LlamaForCausalLM"]
        )
        losses = train(peft_model, data)
        autooffload.disable()
        runs.append(Run(losses, trained_weights(peft_model)))
    assert_same_training(*runs)
