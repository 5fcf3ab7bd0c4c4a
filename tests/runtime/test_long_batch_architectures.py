"""The long-batch machinery on architectures beside Llama: a block probed on a slice of the
sequence computes the first positions exactly as on the whole (its position embeddings and masks
cut with it), tiled MLPs and norms train exactly as untiled, and the fused head's source check
says which models it applies to."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from autooffload.runtime.activations.head_source import forward_check
from autooffload.runtime.activations.tiled_mlp import find_mlp, find_norms, is_tiled, set_mlp_tiles
from autooffload.runtime.blocks import discover_groups
from autooffload.runtime.control.probe import sliced

pytestmark = pytest.mark.usefixtures("one_thread")

_DECODER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 256,
}
# name: (config class, model class, config kwargs, whether the MLP is tiled, fused head applies)
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _DECODER, True, True),
    "mistral": ("MistralConfig", "MistralForCausalLM", _DECODER, True, True),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _DECODER, True, True),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**_DECODER, "head_dim": 8}, True, True),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {**_DECODER, "head_dim": 8}, True, True),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {**_DECODER, "head_dim": 8}, True, False),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {**_DECODER, "pad_token_id": 0}, True, True),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", {**_DECODER, "pad_token_id": 0}, True, True),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {**_DECODER, "num_local_experts": 4, "num_experts_per_tok": 2},
        False,
        True,
    ),
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        {k: v for k, v in _DECODER.items() if k != "num_key_value_heads"},
        True,
        True,
    ),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_inner": 64, "vocab_size": 128},
        True,
        True,
    ),
}


def tiny(name: str) -> torch.nn.Module:
    config_name, model_name, kwargs, _, _ = ARCHITECTURES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**kwargs)
    model = getattr(transformers, model_name)(config)
    for module in model.modules():  # no dropout: the runs compare exactly
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.train()


def blocks_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [g.module for g in discover_groups(model) if g.is_block]


def first_output(out: object) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out  # type: ignore[return-value, index]


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_a_block_on_a_slice_computes_the_first_positions_as_on_the_whole(name: str) -> None:
    model = tiny(name)
    block = blocks_of(model)[0]
    captured: dict = {}
    handle = block.register_forward_pre_hook(
        lambda m, args, kwargs: captured.update(args=args, kwargs=kwargs), with_kwargs=True
    )
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    args, kwargs = captured["args"], captured["kwargs"]
    kwargs = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values")}
    cut_args, cut_kwargs = sliced(args, kwargs, 64, 16)
    with torch.no_grad():
        whole = first_output(block(*args, **kwargs))
        part = first_output(block(*cut_args, **cut_kwargs))
    assert part.shape[1] == 16
    torch.testing.assert_close(part, whole[:, :16], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_tiled_mlps_and_norms_train_as_untiled(name: str) -> None:
    """One forward and backward with every block's MLP and norms in tiles of 8 tokens: the loss
    and every gradient as untiled; a routed (mixture-of-experts) MLP and its block's norms stay
    untiled."""
    base = tiny(name)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(2))

    def step(tiles: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model = copy.deepcopy(base)
        tiled = set_mlp_tiles(blocks_of(model), tiles)
        if tiles:
            expect_tiled = ARCHITECTURES[name][3]
            assert tiled == (len(blocks_of(model)) if expect_tiled else 0)
            for block in blocks_of(model):
                modules = [m for m in (find_mlp(block), *find_norms(block)) if m is not None]
                assert all(is_tiled(m) == expect_tiled for m in modules)
                assert not expect_tiled or len(find_norms(block)) >= 2  # Gemma 2: four
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = step(0)
    tiled_loss, tiled_grads = step(8)
    torch.testing.assert_close(tiled_loss, loss, rtol=1e-6, atol=1e-6)
    assert tiled_grads.keys() == grads.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(tiled_grads[key], grad, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_the_fused_heads_source_check_on_each_architecture(name: str) -> None:
    reason = forward_check(type(tiny(name)))
    assert (reason is None) == ARCHITECTURES[name][4], reason
