"""Helpers for QLoRA tests: tiny Llamas whose decoder linears are bitsandbytes ``Linear4bit``
(quantized where the test runs), and snapshots of every quantized weight and quant state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

bnb = pytest.importorskip("bitsandbytes")

# fp32 compute on the CPU simulation; the GPU tests pass bfloat16.
QUANT_KINDS = {
    "nf4-double": {"quant_type": "nf4", "compress_statistics": True},
    "nf4": {"quant_type": "nf4", "compress_statistics": False},
    "fp4-double": {"quant_type": "fp4", "compress_statistics": True},
}


def quantize_linears(
    model: nn.Module,
    *,
    device: str = "cpu",
    compute_dtype: torch.dtype = torch.float32,
    quant_type: str = "nf4",
    compress_statistics: bool = True,
) -> nn.Module:
    """Replace every ``nn.Linear`` inside the decoder layers by a ``Linear4bit`` quantized on
    ``device`` (the embeddings and the head stay as they are, as in transformers' QLoRA)."""
    for layer in model.model.layers:
        for name, child in list(layer.named_modules()):
            if not isinstance(child, nn.Linear) or isinstance(child, bnb.nn.Linear4bit):
                continue
            parent_name, _, attr = name.rpartition(".")
            parent = layer.get_submodule(parent_name) if parent_name else layer
            quantized = bnb.nn.Linear4bit(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                compute_dtype=compute_dtype,
                compress_statistics=compress_statistics,
                quant_type=quant_type,
                device="meta",
            )
            weight = bnb.nn.Params4bit(
                child.weight.data.to(compute_dtype),
                requires_grad=False,
                compress_statistics=compress_statistics,
                quant_type=quant_type,
                module=quantized,
            )._quantize(torch.device(device))
            quantized.weight = weight
            quantized.quant_state = weight.quant_state
            if child.bias is not None:
                quantized.bias = nn.Parameter(child.bias.data.to(device), requires_grad=False)
            setattr(parent, attr, quantized)
    model.is_loaded_in_4bit = True  # PEFT dispatches its bnb LoRA layers on this flag
    return model


def quant_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every 4-bit weight and every tensor of its quant state, by the layer's name
    in the base model (a PeftModel's wrapping left out)."""
    found: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, bnb.nn.Params4bit):
            continue
        state = weight.quant_state
        name = name.replace(".base_layer", "").removeprefix("base_model.model.")
        found[f"{name}.weight"] = weight.data.detach().clone()
        for attr in ("absmax", "code", "offset"):
            if getattr(state, attr, None) is not None:
                found[f"{name}.{attr}"] = getattr(state, attr).detach().clone()
        if state.state2 is not None:
            for attr in ("absmax", "code"):
                found[f"{name}.state2.{attr}"] = getattr(state.state2, attr).detach().clone()
    return found


def assert_bit_identical(
    expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]
) -> None:
    """Same names, dtypes, shapes and bytes."""
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        other = actual[name]
        assert other.dtype == tensor.dtype and other.shape == tensor.shape, name
        raw = [t.detach().cpu().reshape(-1).view(torch.uint8) for t in (other, tensor)]
        assert torch.equal(*raw), name


def quantized_bytes(model: nn.Module) -> int:
    """Real bytes of the packed 4-bit weights and every tensor of their quant states."""
    return sum(t.numel() * t.element_size() for t in quant_tensors(model).values())


def int8_model(device: str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """The resident-size tiny Llama in ``dtype`` with every decoder linear a ``Linear8bitLt``
    (int8 weights, fp32 row scales ``SCB``), quantized by the move to ``device``."""
    from tests.peft.peft_runs import tiny_llama

    model = tiny_llama("resident").to(dtype)
    for layer in model.model.layers:
        for name, child in list(layer.named_modules()):
            if isinstance(child, nn.Linear):
                parent_name, _, attr = name.rpartition(".")
                quantized = bnb.nn.Linear8bitLt(
                    child.in_features, child.out_features, bias=False, has_fp16_weights=False
                )
                quantized.weight = bnb.nn.Int8Params(
                    child.weight.data.clone(), requires_grad=False, has_fp16_weights=False
                )
                setattr(layer.get_submodule(parent_name), attr, quantized.to(device))
    model.is_loaded_in_8bit = True
    return model
