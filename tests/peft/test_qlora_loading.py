"""QLoRA the way scripts load it: ``from_pretrained(quantization_config=BitsAndBytesConfig(...))``.

transformers quantizes such a load straight onto the GPU, where nothing would attach it. Under
offload it is quantized on the host and attached on the device transformers would have used
(``patches/transformers_loading.py``); ``prepare_model_for_kbit_training`` on the attached
model detaches it for PEFT's fp32 casts and attaches it again (``patches/peft_lora.py``).

CPU simulation, bf16 weights (PEFT's casts then change dtypes): every flow trains exactly like
the same script without autooffload. The GPU version is in ``tests/gpu/test_qlora_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

# Bound at import, before any enable(), as a script does: enable() patches this module's name too.
from peft import get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402  (after bnb skip)

import autooffload
from autooffload import runtime as rt
from autooffload.errors import AttachError
from tests.peft.peft_runs import batches, enable_cpu, lora, runtime_for, tiny_llama, train
from tests.peft.qlora_runs import bnb

STEPS = 4
QUANT = {
    "nf4": dict(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    ),
    "int8": dict(load_in_8bit=True),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random-init Llama saved in bf16, as a hub checkpoint is."""
    path = tmp_path_factory.mktemp("llama-bf16")
    tiny_llama("resident").to(torch.bfloat16).save_pretrained(path)
    return path


def load(path, quant: str | None, **kwargs) -> torch.nn.Module:
    config = BitsAndBytesConfig(**QUANT[quant]) if quant else None
    return AutoModelForCausalLM.from_pretrained(
        path, quantization_config=config, dtype=torch.bfloat16, **kwargs
    )


def qlora_script(path, quant: str | None, prepare: bool, **load_kwargs) -> list[float]:
    """The usual script: load, (prepare for k-bit training), get_peft_model, train."""
    model = load(path, quant, **load_kwargs)
    if prepare:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(123)  # adapter init
    peft_model = get_peft_model(model, lora(target_modules=["q_proj", "v_proj", "down_proj"]))
    peft_model.train()  # from_pretrained returns eval mode; bnb repacks eval weights on CPU
    if autooffload.settings.current() is not None:
        assert runtime_for(peft_model) is not None, "the loaded model was not attached"
    return train(peft_model, batches(STEPS))


@pytest.mark.parametrize("prepare", [False, True], ids=["peft-only", "prepare-kbit"])
@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_quantized_load_attaches_and_trains_like_the_plain_script(checkpoint, quant, prepare):
    expected = qlora_script(checkpoint, quant, prepare)
    enable_cpu()
    actual = qlora_script(checkpoint, quant, prepare)
    assert actual == expected


def test_attached_on_load_with_the_quantized_bytes_chunked(checkpoint):
    enable_cpu()
    model = load(checkpoint, "nf4")
    runtime = rt.runtime_of(model)
    assert runtime is not None
    # Loaded on the host for the move; the placement is the runtime's, not a dispatch map.
    assert getattr(model, "hf_device_map", None) is None
    weight = model.model.layers[0].self_attn.q_proj.weight
    assert isinstance(weight, bnb.nn.Params4bit) and weight.bnb_quantized
    assert runtime.owns(weight)
    assert runtime.quantized.of(weight), "the quant state did not go into the chunk"


def test_prepare_keeps_the_model_attached_with_its_fp32_casts(checkpoint):
    enable_cpu()
    model = load(checkpoint, "nf4")
    first = rt.runtime_of(model)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    runtime = rt.runtime_of(model)
    assert runtime is not None and runtime is not first
    assert not any(p.requires_grad for p in model.parameters())
    norm = model.model.layers[0].input_layernorm.weight
    assert norm.dtype == torch.float32 and runtime.owns(norm)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.uint8


def test_prepare_after_an_optimizer_is_a_clear_error(checkpoint):
    enable_cpu()
    model = load(checkpoint, None, device_map="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # held, as a script holds it
    with pytest.raises(AttachError, match="before creating the optimizer"):
        prepare_model_for_kbit_training(model)
    assert rt.runtime_of(model).optimizers == [optimizer]


def test_a_checkpoint_saved_quantized_attaches_on_load(checkpoint, tmp_path):
    quantized = load(checkpoint, "nf4", device_map="cpu")
    quantized.save_pretrained(tmp_path)
    enable_cpu()
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    runtime = rt.runtime_of(model)
    assert runtime is not None
    weight = model.model.layers[0].mlp.down_proj.weight
    assert runtime.owns(weight)
    autooffload.disable()  # detach: every quantized byte back in ordinary tensors
    assert torch.equal(weight.data, quantized.model.layers[0].mlp.down_proj.weight.data)


@pytest.mark.parametrize("device_map", ["auto", "sequential", {"": "cpu"}])
def test_a_placement_onto_the_one_device_attaches(checkpoint, device_map):
    enable_cpu()
    model = load(checkpoint, None, device_map=device_map)
    assert rt.runtime_of(model) is not None
    assert getattr(model, "hf_device_map", None) is None


def test_no_map_without_quantization_stays_a_host_load(checkpoint):
    enable_cpu()
    model = load(checkpoint, None)
    assert rt.runtime_of(model) is None


def test_prepare_bound_before_enable_detaches_and_is_restored(checkpoint):
    import peft.utils.other

    bound = peft.utils.other.prepare_model_for_kbit_training  # a name bound before enable()
    code = bound.__code__
    enable_cpu()
    model = load(checkpoint, "nf4")
    model = bound(model, use_gradient_checkpointing=False)  # reads offloaded params if attached
    assert rt.runtime_of(model) is not None
    assert model.model.norm.weight.dtype == torch.float32
    autooffload.disable()
    assert bound.__code__ is code
    assert not [name for name in vars(peft.utils.other) if name.startswith("__autooffload")]
