"""On a GPU: QLoRA (bf16 compute, nf4 + double quantization, quantized by bitsandbytes' CUDA
kernels) and int8 LoRA with every base chunk offloaded train like plain PEFT, with torch's
AdamW and with bitsandbytes' 8-bit and paged optimizers; ``disable()`` gives back every
quantized byte and quant-state tensor unchanged; the state dict equals the plain one."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import PeftModel, get_peft_model, prepare_model_for_kbit_training

import autooffload
from tests.peft.peft_runs import batches, lora, runtime_for, tiny_llama, trained_weights
from tests.peft.qlora_runs import (
    assert_bit_identical,
    bnb,
    int8_model,
    quant_tensors,
    quantize_linears,
)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("clean_gpu")]

STEPS = 20
# Both runs do the same bf16 math on the same device: the frozen base is the same bytes
# (dequantized by the same kernel), the adapters stay resident and are stepped by the same
# optimizer. Expected bit-identical; the bounds allow a different cuBLAS algorithm for a
# differently aligned buffer (~1 bf16 ulp, 0.4%). A stale chunk or a wrong quant state moves
# the losses by 0.1 or more.
LOSS_ATOL = 2e-2
ADAPTER_RTOL = 2e-2
ADAPTER_ATOL = 2e-3
OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True),
    "adamw8bit": lambda params: bnb.optim.AdamW8bit(params, lr=1e-3),
    "paged_adamw": lambda params: bnb.optim.PagedAdamW(params, lr=1e-3),
}


def nf4_model() -> torch.nn.Module:
    model = tiny_llama("resident").to(torch.bfloat16)
    return quantize_linears(model, device="cuda", compute_dtype=torch.bfloat16)


def wrap(base: torch.nn.Module, attached: bool) -> PeftModel:
    model = prepare_model_for_kbit_training(copy.deepcopy(base), use_gradient_checkpointing=True)
    torch.manual_seed(123)
    model = get_peft_model(model, lora(target_modules=["q_proj", "v_proj"]))
    if attached:
        autooffload.enable(force_attach=True, chunk_size=40_000, n_persist=0, mask=False)
    model.to("cuda")
    assert (runtime_for(model) is not None) == attached
    return model


def train(model: torch.nn.Module, optimizer: str) -> list[float]:
    opt = OPTIMIZERS[optimizer]([p for p in model.parameters() if p.requires_grad])
    losses = []
    for ids in batches(STEPS):
        ids = ids.cuda()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def assert_close_runs(expected: tuple, actual: tuple) -> None:
    torch.testing.assert_close(
        torch.tensor(actual[0]), torch.tensor(expected[0]), rtol=0, atol=LOSS_ATOL
    )
    assert actual[1].keys() == expected[1].keys()
    for name, weight in expected[1].items():
        torch.testing.assert_close(
            actual[1][name], weight, rtol=ADAPTER_RTOL, atol=ADAPTER_ATOL, msg=name
        )


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_qlora_bf16_attached_matches_plain(optimizer):
    base = nf4_model()
    original = quant_tensors(base)
    plain = wrap(base, attached=False)
    expected = (train(plain, optimizer), trained_weights(plain))
    plain_state = {k: v.cpu() for k, v in plain.state_dict().items()}
    del plain

    model = wrap(base, attached=True)
    runtime = runtime_for(model)
    quantized = [p for p in model.parameters() if isinstance(p, bnb.nn.Params4bit)]
    assert quantized and all(runtime.is_offloaded(p) for p in quantized)
    losses = train(model, optimizer)
    assert runtime.stats()["d2h_bytes"] == 0, "a frozen quantized chunk sent gradients back"
    state = {k: v.cpu() for k, v in model.state_dict().items()}
    autooffload.disable()

    assert_close_runs(expected, (losses, trained_weights(model)))
    assert_bit_identical(original, quant_tensors(model))
    assert state.keys() == plain_state.keys()
    for key, value in plain_state.items():
        if "lora_" not in key:
            assert torch.equal(state[key], value), key


def test_qlora_chunk_frees_quant_state_on_the_device():
    """With every chunk offloaded, no quant-state tensor holds device memory between blocks."""
    model = wrap(nf4_model(), attached=True)
    runtime = runtime_for(model)
    for weight in (p for p in model.parameters() if isinstance(p, bnb.nn.Params4bit)):
        companions = runtime.quantized.of(weight)
        assert len(companions) == 5
        assert all(t.is_cuda and t.untyped_storage().nbytes() == 0 for t in companions)


def test_int8_lora_attached_matches_plain_on_gpu():
    base = int8_model("cuda", torch.bfloat16)
    plain = wrap(base, attached=False)
    expected = (train(plain, "adamw"), trained_weights(plain))
    del plain
    model = wrap(base, attached=True)
    weights = [p for p in model.parameters() if p.dtype == torch.int8]
    assert weights and all(runtime_for(model).is_offloaded(p) for p in weights)
    losses = train(model, "adamw")
    autooffload.disable()
    assert_close_runs(expected, (losses, trained_weights(model)))


def _from_pretrained_qlora(checkpoint, attached: bool, device_map=None) -> tuple:
    """The usual QLoRA script: ``from_pretrained(quantization_config=nf4)`` (no device_map:
    bitsandbytes places it on the current GPU), ``prepare_model_for_kbit_training``,
    ``get_peft_model``, train. Attached, the load is quantized on the host and attached."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if attached:
        autooffload.enable(force_attach=True, chunk_size=40_000, n_persist=0, mask=False)
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, quantization_config=quant, dtype=torch.bfloat16, device_map=device_map
    )
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    torch.manual_seed(123)
    peft_model = get_peft_model(model, lora(target_modules=["q_proj", "v_proj"]))
    peft_model.train()
    runtime = runtime_for(peft_model)
    assert (runtime is not None) == attached
    if attached:
        quantized = [p for p in peft_model.parameters() if isinstance(p, bnb.nn.Params4bit)]
        assert quantized and all(runtime.is_offloaded(p) for p in quantized)
    losses = train(peft_model, "adamw")
    weights = trained_weights(peft_model)
    autooffload.disable()
    return losses, weights, quant_tensors(peft_model)


# No map (bitsandbytes picks the current GPU), accelerate's "auto" on one GPU (TRL's default).
@pytest.mark.parametrize("device_map", [None, "auto"], ids=["no-map", "auto"])
def test_from_pretrained_qlora_attaches_and_trains_like_the_plain_load(tmp_path, device_map):
    tiny_llama("resident").to(torch.bfloat16).save_pretrained(tmp_path)
    *expected, cuda_quantized = _from_pretrained_qlora(tmp_path, False, device_map)
    *actual, host_quantized = _from_pretrained_qlora(tmp_path, True, device_map)
    # Quantized by bitsandbytes' CPU kernels here, its CUDA kernels in the plain load: the
    # same codes and scales are expected; the count of differing bytes is printed if not.
    differing = {
        name: int((host_quantized[name].cpu() != tensor.cpu()).sum())
        for name, tensor in cuda_quantized.items()
    }
    print("bytes differing between host and CUDA quantization:", sum(differing.values()))
    assert_bit_identical(cuda_quantized, host_quantized)
    assert_close_runs(tuple(expected), tuple(actual))
