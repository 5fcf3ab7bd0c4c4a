"""Architectures beyond Llama train exactly like plain torch with every chunk offloaded and every
block checkpointed or swapped: decoders (dense, MoE with shared experts, multi-head latent
attention, biased, odd shapes), encoders, encoder-decoders, vision and state-space models; and
models whose layers sit in containers other than a ``ModuleList`` (not found as blocks, their
weights still stream).

Each model is a tiny random-init one built from its transformers config; three AdamW steps on one
batch, losses and final weights compared with the plain run.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import transformers
from torch import nn

import autooffload
from autooffload import runtime as rt
from autooffload.runtime.blocks import discover_groups

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 3
VOCAB = 97  # not a multiple of anything a kernel or a chunk could round to
# Same math in both runs: most cases are bit-identical, T5 and Falcon's new decoder differ by up
# to 1.3e-6 (measured). A bookkeeping slip (a stale chunk, a lost gradient) moves a weight by
# ~lr = 1e-2.
RTOL = 1e-5
ATOL = 1e-5

# GPT-2's key bias has a zero gradient in exact arithmetic (softmax ignores a shift common to a
# row's scores); its rounding noise differs with and without a KV cache (a recompute runs without
# one, as under HF's checkpointing), and AdamW scales it up to 2.3e-5 in 3 steps, as between two
# plain runs that differ only in ``use_cache`` (measured).
ATOL_OF = {"gpt2-with-cache": 5e-5}

_DECODER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
}
_ENCODER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
    "num_labels": 3,
}
_SEQ2SEQ = {
    "d_model": 32,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "vocab_size": VOCAB,
}
_MLA = {
    "num_hidden_layers": 3,
    "num_key_value_heads": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,  # a dense block before the MoE ones
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
}


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(1)


def causal_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, 16), generator=_generator())
    return {"input_ids": ids, "labels": ids}


def classify_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (2, 16), generator=_generator())
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 2])}


def seq2seq_batch() -> dict[str, torch.Tensor]:
    generator = _generator()
    ids = torch.randint(3, VOCAB, (2, 16), generator=generator)
    return {"input_ids": ids, "labels": torch.randint(3, VOCAB, (2, 8), generator=generator)}


def audio_batch() -> dict[str, torch.Tensor]:
    generator = _generator()
    features = torch.randn(2, 8, 32, generator=generator)  # 8 mel bins, 32 frames
    return {
        "input_features": features,
        "labels": torch.randint(3, VOCAB, (2, 8), generator=generator),
    }


def image_batch() -> dict[str, torch.Tensor]:
    pixels = torch.randn(2, 3, 16, 16, generator=_generator())
    return {"pixel_values": pixels, "labels": torch.tensor([0, 2])}


# name: (config class, model class, config kwargs, batch)
ARCHITECTURES: dict[str, tuple[str, str, dict, Callable[[], dict[str, torch.Tensor]]]] = {
    "falcon": (
        "FalconConfig",
        "FalconForCausalLM",
        {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": VOCAB},
        causal_batch,
    ),
    "falcon-new-decoder": (
        "FalconConfig",
        "FalconForCausalLM",
        {
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_kv_heads": 2,
            "new_decoder_architecture": True,
            "vocab_size": VOCAB,
        },
        causal_batch,
    ),
    "phi": (
        "PhiConfig",
        "PhiForCausalLM",
        {**_DECODER, "partial_rotary_factor": 0.5},
        causal_batch,
    ),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", _DECODER, causal_batch),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", _DECODER, causal_batch),
    "cohere": ("CohereConfig", "CohereForCausalLM", {**_DECODER, "pad_token_id": 0}, causal_batch),
    "granite-untied": (
        "GraniteConfig",
        "GraniteForCausalLM",
        {
            **_DECODER,
            "tie_word_embeddings": False,
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
            "logits_scaling": 4.0,
        },
        causal_batch,
    ),
    "gemma3-text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {**_DECODER, "head_dim": 8, "sliding_window": 8, "pad_token_id": 0},
        causal_batch,
    ),
    "llama-biases": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {**_DECODER, "attention_bias": True, "mlp_bias": True},
        causal_batch,
    ),
    "llama-one-block-odd-shapes": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            **_DECODER,
            "hidden_size": 40,
            "intermediate_size": 72,
            "num_attention_heads": 5,
            "num_key_value_heads": 1,
            "num_hidden_layers": 1,
            "tie_word_embeddings": False,
        },
        causal_batch,
    ),
    "llama-many-tiny-blocks": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            **_DECODER,
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "num_hidden_layers": 12,
        },
        causal_batch,
    ),
    "qwen2-moe-shared-expert": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            **_DECODER,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 32,
            "output_router_logits": True,  # the router's auxiliary loss joins the loss
        },
        causal_batch,
    ),
    "qwen3-moe-untied": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            **_DECODER,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "head_dim": 8,
            "tie_word_embeddings": False,
        },
        causal_batch,
    ),
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        {**_DECODER, "num_experts": 4, "num_experts_per_tok": 2, "pad_token_id": 0},
        causal_batch,
    ),
    "deepseek-v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        {**_DECODER, **_MLA},
        causal_batch,
    ),
    "deepseek-v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {**_DECODER, **_MLA, "n_group": 1, "topk_group": 1},
        causal_batch,
    ),
    # GPT-2 passes its KV cache to a block positionally; eager attention fails on a cache
    # appended to twice, where SDPA's causal mask could hide it.
    "gpt2-with-cache": (
        "GPT2Config",
        "GPT2LMHeadModel",
        {
            "n_embd": 32,
            "n_layer": 2,
            "n_head": 4,
            "n_inner": 64,
            "vocab_size": VOCAB,
            "attn_implementation": "eager",
        },
        causal_batch,
    ),
    "mamba": (
        "MambaConfig",
        "MambaForCausalLM",
        {"hidden_size": 32, "num_hidden_layers": 2, "vocab_size": VOCAB, "state_size": 4},
        causal_batch,
    ),
    "bert": ("BertConfig", "BertForSequenceClassification", _ENCODER, classify_batch),
    "distilbert": (
        "DistilBertConfig",
        "DistilBertForSequenceClassification",
        {
            "dim": 32,
            "n_layers": 2,
            "n_heads": 4,
            "hidden_dim": 64,
            "vocab_size": VOCAB,
            "num_labels": 3,
        },
        classify_batch,
    ),
    "roberta": ("RobertaConfig", "RobertaForSequenceClassification", _ENCODER, classify_batch),
    "deberta-v2": (
        "DebertaV2Config",
        "DebertaV2ForSequenceClassification",
        {
            **_ENCODER,
            "relative_attention": True,
            "position_buckets": 8,
            "pos_att_type": ["p2c", "c2p"],
        },
        classify_batch,
    ),
    "modernbert": (
        "ModernBertConfig",
        "ModernBertForSequenceClassification",
        {
            **_ENCODER,
            "num_hidden_layers": 3,
            "global_attn_every_n_layers": 2,
            "local_attention": 8,
            "pad_token_id": 0,
        },
        classify_batch,
    ),
    "bart": ("BartConfig", "BartForConditionalGeneration", _SEQ2SEQ, seq2seq_batch),
    "t5": (
        "T5Config",
        "T5ForConditionalGeneration",
        {
            "d_model": 32,
            "d_ff": 64,
            "d_kv": 8,
            "num_layers": 2,
            "num_heads": 4,
            "vocab_size": VOCAB,
            "relative_attention_num_buckets": 8,
            "decoder_start_token_id": 0,
        },
        seq2seq_batch,
    ),
    "whisper": (
        "WhisperConfig",
        "WhisperForConditionalGeneration",
        {
            **_SEQ2SEQ,
            "num_mel_bins": 8,
            "max_source_positions": 16,
            "max_target_positions": 32,
            "decoder_start_token_id": 1,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
        audio_batch,
    ),
    "vit": (
        "ViTConfig",
        "ViTForImageClassification",
        {**_ENCODER, "image_size": 16, "patch_size": 4},
        image_batch,
    ),
    "clip-vision": (
        "CLIPConfig",
        "CLIPForImageClassification",
        {
            "vision_config": {**_ENCODER, "image_size": 16, "patch_size": 4},
            "text_config": {**_ENCODER, "num_hidden_layers": 1},
            "num_labels": 3,
        },
        image_batch,
    ),
}


def tiny(name: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The named model, random-init without dropout or layer drop, and its batch."""
    config_name, model_name, kwargs, batch = ARCHITECTURES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**kwargs)
    for key, value in config.to_dict().items():
        if isinstance(value, float) and ("dropout" in key or "layerdrop" in key):
            setattr(config, key, 0.0)
    model = getattr(transformers, model_name)(config)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model.train(), batch()


def train(
    model: nn.Module, batch: dict[str, torch.Tensor], attach: dict | None, offload_cpu
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and final weights of ``STEPS`` AdamW steps on ``batch``; ``attach`` settings
    attach the model first."""
    if attach is not None:
        offload_cpu(**attach)
        model.to("cpu")
        runtime = rt.runtime_of(model)
        assert runtime is not None, "the move to cpu did not attach the model"
        assert all(runtime.is_offloaded(p) for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    losses = []
    for _ in range(STEPS):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    autooffload.disable()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_trains_like_plain(
    base: nn.Module, batch: dict[str, torch.Tensor], attach: dict, offload_cpu, atol: float = ATOL
) -> None:
    plain_losses, plain_weights = train(copy.deepcopy(base), batch, None, offload_cpu)
    losses, weights = train(copy.deepcopy(base), batch, attach, offload_cpu)
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(plain_losses), rtol=RTOL, atol=ATOL
    )
    assert weights.keys() == plain_weights.keys()
    initial = base.state_dict()
    moved = max((plain_weights[k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-2, "the reference did not train; the comparison proves nothing"
    for key, weight in plain_weights.items():
        torch.testing.assert_close(weights[key], weight, rtol=RTOL, atol=atol, msg=key)


@pytest.mark.parametrize("mode", ["checkpoint", "swap"])
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_architecture_trains_like_plain_with_every_chunk_offloaded(
    offload_cpu, name: str, mode: str
) -> None:
    base, batch = tiny(name)
    attach = {"n_persist": 0, "activation_mode": mode}
    assert_trains_like_plain(base, batch, attach, offload_cpu, ATOL_OF.get(name, ATOL))


def test_a_kv_cache_passed_positionally_is_dropped_from_probes_and_recomputes(
    offload_cpu,
) -> None:
    """GPT-2 fills a KV cache in a training forward and hands it to each block as a positional
    argument: the searched plan's profiling probe and a checkpointed block's recompute run the
    block without it (appended to twice, the keys outnumbered the mask), and training is
    plain's."""
    base, batch = tiny("gpt2-with-cache")
    assert base.config.use_cache
    assert_trains_like_plain(base, batch, {}, offload_cpu, ATOL_OF["gpt2-with-cache"])


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class _Output:
    def __init__(self, loss: torch.Tensor) -> None:
        self.loss = loss


class _Net(nn.Module):
    """Blocks in an ``nn.ModuleDict`` or in ``nn.Sequential`` inside ``nn.Sequential``."""

    def __init__(self, container: str, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        if container == "dict":
            self.body = nn.ModuleDict({f"block{i}": _Block(width) for i in range(3)})
        elif container == "sequential":
            self.body = nn.Sequential(*(_Block(width) for _ in range(3)))
        else:
            self.body = nn.Sequential(
                *(nn.Sequential(_Block(width), _Block(width)) for _ in range(2))
            )
        self.head = nn.Linear(width, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> _Output:
        x = self.embed(input_ids)
        blocks = self.body.values() if isinstance(self.body, nn.ModuleDict) else [self.body]
        for block in blocks:
            x = block(x)
        logits = self.head(x)
        return _Output(nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))


@pytest.mark.parametrize("mode", ["checkpoint", "swap"])
@pytest.mark.parametrize("container", ["dict", "sequential", "nested-sequential"])
def test_blocks_outside_a_module_list_train_like_plain(
    offload_cpu, container: str, mode: str
) -> None:
    torch.manual_seed(0)
    base = _Net(container)
    attach = {"n_persist": 0, "activation_mode": mode}
    assert_trains_like_plain(base, causal_batch(), attach, offload_cpu)


@pytest.mark.parametrize("container", ["sequential", "nested-sequential"])
def test_blocks_in_a_sequential_are_checkpointed(offload_cpu, container: str) -> None:
    """The activation mode acts on them: each block's layers run again in the backward."""
    torch.manual_seed(0)
    model = _Net(container)
    offload_cpu(n_persist=0, activation_mode="checkpoint")
    model.to("cpu")
    first = model.body[0] if container == "sequential" else model.body[0][0]
    calls = []
    first.up.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    model(**causal_batch()).loss.backward()
    autooffload.disable()
    assert len(calls) == 2, "the block's layers ran once: it was not checkpointed"


def test_weights_a_module_reads_from_an_uncalled_child_are_gathered_with_it() -> None:
    """DeBERTa's encoder reads its relative position embeddings' weight and never calls the
    embedding: the weight is the encoder's group's, gathered before the encoder's code reads
    it, not a group of its own that no forward hook would ever gather."""
    model, _ = tiny("deberta-v2")
    groups = {g.name: g for g in discover_groups(model)}
    assert "deberta.encoder.rel_embeddings" not in groups
    encoder = groups["deberta.encoder"]
    assert [name for name, _ in encoder.params()] == ["deberta.encoder.rel_embeddings.weight"]
