"""Code inside a decoder layer that reads another module's weight directly (fused LoRA-MLP
kernels take gate/up/down weights at once) sees the resident weights: residency is per block."""

from __future__ import annotations

import copy

import torch
from torch import nn

import autooffload
from autooffload import runtime as rt
from tests.peft.peft_runs import RTOL, batches, enable_cpu, lora, tiny_llama, train, wrap


class FusedMlpRead(nn.Module):
    """Adds ``scale * x @ gate.W^T`` computed from the gate's weight, not by calling the gate."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp
        self.scale = nn.Parameter(torch.full((1,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.mlp.gate_proj
        weight = gate.get_base_layer().weight if hasattr(gate, "get_base_layer") else gate.weight
        extra = x @ weight[: x.shape[-1]].t()
        return self.mlp(x) + self.scale * extra


def with_fused_reads(model: nn.Module) -> nn.Module:
    for layer in model.model.layers:
        layer.mlp = FusedMlpRead(layer.mlp)
    return model


def test_a_block_reading_a_linear_weight_directly_trains_like_plain():
    base, data = with_fused_reads(tiny_llama()), batches(8)
    runs = []
    for attach in (False, True):
        model = copy.deepcopy(base)
        if attach:
            enable_cpu()
            model.to("cpu")
            runtime = rt.runtime_of(model)
            gate = model.model.layers[0].mlp.mlp.gate_proj.weight
            assert runtime.is_offloaded(gate)
        losses = train(model, data)
        autooffload.disable()
        runs.append((losses, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (plain_losses, plain_w), (losses, weights) = runs
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(plain_losses), rtol=RTOL, atol=RTOL
    )
    for name in plain_w:
        torch.testing.assert_close(weights[name], plain_w[name], rtol=RTOL, atol=RTOL, msg=name)


def test_a_fused_read_of_a_lora_base_weight_inside_the_block_matches_plain():
    base, data = tiny_llama(), batches(6)
    runs = []
    for order in ("plain", "peft_then_move"):
        model = wrap(copy.deepcopy(base), lora(), order, "resident")
        for layer in model.base_model.model.model.layers:
            layer.mlp = FusedMlpRead(layer.mlp)
        runs.append(train(model, data))
        autooffload.disable()
    torch.testing.assert_close(torch.tensor(runs[1]), torch.tensor(runs[0]), rtol=RTOL, atol=RTOL)
