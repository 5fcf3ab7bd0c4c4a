"""A bf16 base with fp32 LoRA adapters: each LoRA layer's upcast input is saved as the bf16
input itself (``saved_upcasts``), training exactly as with PEFT's fp32 copies."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model

import autooffload
from tests.peft.peft_runs import (
    SEQ,
    batches,
    enable_cpu,
    lora,
    runtime_for,
    tiny_llama,
    train,
    trained_weights,
)

BF16, FP32 = torch.bfloat16, torch.float32


def _attached(saved_upcasts: bool, mode: str, explicit: bool = False) -> torch.nn.Module:
    """The PEFT model attached by its move under ``enable()``, or by ``attach()`` (which holds
    the PEFT patches while it is attached) with ``explicit``."""
    settings = {"saved_upcasts": saved_upcasts, "activation_mode": mode}
    if not explicit:
        enable_cpu(**settings)
    base = tiny_llama().to(BF16)
    torch.manual_seed(123)
    model = get_peft_model(base, lora())
    lora_a = next(p for n, p in model.named_parameters() if "lora_A" in n)
    assert lora_a.dtype == FP32  # PEFT keeps the adapters in fp32 beside a bf16 base
    if explicit:
        autooffload.attach(model, device="cpu", force_attach=True, n_persist=0, **settings)
    else:
        model.to("cpu")
    assert runtime_for(model) is not None
    return model


def _train(saved_upcasts: bool, mode: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _attached(saved_upcasts, mode)
    losses = train(model, batches(6))
    weights = trained_weights(model)
    autooffload.disable()
    return losses, weights


@pytest.mark.parametrize("mode", ["keep", "checkpoint", "swap"])
def test_training_equals_pefts_fp32_copies_bit_for_bit(mode: str) -> None:
    losses, weights = _train(True, mode)
    plain_losses, plain_weights = _train(False, mode)
    assert losses == plain_losses
    assert weights.keys() == plain_weights.keys()
    for name, value in weights.items():
        assert torch.equal(value, plain_weights[name]), name


@pytest.mark.parametrize("explicit", [False, True], ids=["enable", "attach"])
def test_the_bf16_input_is_saved_where_each_lora_layer_saved_an_fp32_copy(explicit: bool) -> None:
    """Counted by a hook around a training forward: as many tensors saved, and the fp32 bytes
    fall by one fp32 copy of the input of every LoRA linear (7 a layer, 3 layers)."""

    def saved(saved_upcasts: bool) -> tuple[int, int, int]:
        model = _attached(saved_upcasts, "keep", explicit)
        sizes: dict[torch.dtype, int] = {}
        count = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            count[0] += 1
            sizes[t.dtype] = sizes.get(t.dtype, 0) + t.numel() * t.element_size()
            return t

        ids = batches(1)[0]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, labels=ids).loss.backward()
        inputs = sum(
            m.in_features
            for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n.endswith("lora_A.default")
        )
        autooffload.disable()
        return count[0], sizes.get(FP32, 0), inputs * ids.numel()

    count, fp32, elements = saved(True)
    plain_count, plain_fp32, _ = saved(False)
    assert count == plain_count
    assert plain_fp32 - fp32 == 4 * elements
    assert SEQ * 7 * 3 <= elements


@pytest.mark.parametrize("mode", ["keep", "checkpoint"])
def test_tiled_mlps_train_the_same_with_saved_upcasts(mode: str) -> None:
    """A tiled MLP runs its LoRA layers again tile by tile in its backward: their upcasts are
    saved as their inputs there too, and training is the same bit for bit."""
    from autooffload.runtime.activations.tiled_mlp import find_mlp, is_tiled, set_mlp_tiles

    def run(saved_upcasts: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
        model = _attached(saved_upcasts, mode)
        data = batches(6)
        losses = train(model, data[:3])  # profiling, then the searched plan
        layers = model.get_base_model().model.layers
        assert set_mlp_tiles(layers, 8) == len(layers)
        losses += train(model, data[3:])
        assert all(is_tiled(find_mlp(layer)) for layer in layers)
        weights = trained_weights(model)
        autooffload.disable()
        return losses, weights

    (losses, weights), (plain_losses, plain_weights) = run(True), run(False)
    assert losses == plain_losses
    for name, value in weights.items():
        assert torch.equal(value, plain_weights[name]), name


def test_a_checkpointed_lora_layers_input_is_not_held_past_its_forward() -> None:
    """In a checkpointed block nothing holds a LoRA layer's upcast input after the forward:
    the attention output ``o_proj`` reads is freed before the backward, as without
    ``saved_upcasts`` (held, Llama-3-8B at seq 98304 kept ~2.3 GiB a block on the device)."""
    import gc
    import weakref

    held = {}
    for saved_upcasts in (True, False):
        model = _attached(saved_upcasts, "checkpoint")
        data = batches(4)
        train(model, data[:3])  # profiling, then the searched plan under the fixed mode
        refs: list[weakref.ref] = []
        layers = model.get_base_model().model.layers
        handles = [
            layer.self_attn.o_proj.register_forward_pre_hook(
                lambda _m, args, refs=refs: refs.append(weakref.ref(args[0]))
            )
            for layer in layers
        ]
        loss = model(input_ids=data[3], labels=data[3]).loss
        gc.collect()
        held[saved_upcasts] = sum(ref() is not None for ref in refs)
        assert len(refs) == len(layers)
        loss.backward()
        for handle in handles:
            handle.remove()
        autooffload.disable()
    assert held == {True: 0, False: 0}
