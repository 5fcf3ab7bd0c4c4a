"""Tiny random-init vision-language models of four architectures
(Qwen2-VL, Qwen2.5-VL, Llama-3.2-Vision, Gemma 3), each with one real image batch."""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 256
TEXT = 12  # text tokens per sample after the image
BATCH = 2
# Token ids inside the tiny vocabulary.
IMAGE, START, END = 250, 251, 252

ARCHS = ("qwen2_vl", "qwen2_5_vl", "mllama", "gemma3")
# The vision tower's attribute on the inner model, per architecture.
TOWER = {
    "qwen2_vl": "visual",
    "qwen2_5_vl": "visual",
    "mllama": "vision_model",
    "gemma3": "vision_tower",
}


def _text(**extra) -> dict:
    return dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **extra,
    )


def _qwen_vl(arch: str) -> nn.Module:
    if arch == "qwen2_vl":
        from transformers import Qwen2VLConfig as Config
        from transformers import Qwen2VLForConditionalGeneration as Model

        vision = dict(depth=2, embed_dim=32, num_heads=2, hidden_size=64, mlp_ratio=2)
    else:
        from transformers import Qwen2_5_VLConfig as Config
        from transformers import Qwen2_5_VLForConditionalGeneration as Model

        vision = dict(
            depth=2,
            hidden_size=32,
            num_heads=2,
            intermediate_size=64,
            out_hidden_size=64,
            fullatt_block_indexes=[1],
            window_size=28,
        )
    # head_dim 16: the rotary half-dim 8 split over (time, height, width).
    text = _text(rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, use_cache=False)
    config = Config(
        text_config=text,
        vision_config=dict(vision, patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=IMAGE,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )
    return Model(config)


def _mllama() -> nn.Module:
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_global_layers=1,
        attention_heads=2,
        image_size=28,
        patch_size=14,
        max_num_tiles=2,
        intermediate_layers_indices=[0],
        vision_output_dim=64,  # hidden_size x (len(intermediate_layers_indices) + 1)
        supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]],
    )
    # Layer 1 of 3 is a cross-attention layer: the decoder list mixes two layer classes.
    text = _text(cross_attention_layers=[1], use_cache=False)
    text["num_hidden_layers"] = 3
    config = MllamaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE)
    return MllamaForConditionalGeneration(config)


def _gemma3() -> nn.Module:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = _text(head_dim=16, query_pre_attn_scalar=16, sliding_window=64, use_cache=False)
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
        vision_use_head=False,
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=START,
        eoi_token_index=END,
        image_token_index=IMAGE,
    )
    return Gemma3ForConditionalGeneration(config)


def tiny_vlm(arch: str, seed: int = 0) -> nn.Module:
    """A random-init fp32 VLM of ``arch`` (one of ``ARCHS``) in train mode."""
    torch.manual_seed(seed)
    if arch in ("qwen2_vl", "qwen2_5_vl"):
        model = _qwen_vl(arch)
    elif arch == "mllama":
        model = _mllama()
    elif arch == "gemma3":
        model = _gemma3()
    else:
        raise ValueError(f"unknown arch {arch!r}; one of {ARCHS}")
    return model.train()


def vision_tower(model: nn.Module) -> nn.Module:
    """The vision tower of a (PEFT-wrapped or not) VLM built by ``tiny_vlm``."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    return getattr(base.model, TOWER[base.config.model_type])  # ARCHS are the model types


def _ids(n_image: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """<start> <image> x n_image <end> text; labels -100 over the image part."""
    text = torch.randint(3, IMAGE, (BATCH, TEXT), generator=generator)
    image = torch.full((BATCH, n_image), IMAGE)
    start = torch.full((BATCH, 1), START)
    end = torch.full((BATCH, 1), END)
    ids = torch.cat([start, image, end, text], dim=1)
    labels = ids.clone()
    labels[:, : n_image + 2] = -100
    return ids, labels


def vlm_batch(arch: str, seed: int = 1) -> dict[str, torch.Tensor]:
    """One batch of ``BATCH`` samples, one 28x28 image each, in the model's input format."""
    generator = torch.Generator().manual_seed(seed)
    if arch in ("qwen2_vl", "qwen2_5_vl"):
        # 28 px / patch 14 = a 2x2 grid, merged 2x2 into one image token.
        ids, labels = _ids(1, generator)
        pixels = torch.randn(BATCH * 4, 3 * 2 * 14 * 14, generator=generator)
        mm_types = (ids == IMAGE).long()
        return {
            "input_ids": ids,
            "labels": labels,
            "pixel_values": pixels,
            "image_grid_thw": torch.tensor([[1, 2, 2]] * BATCH),
            "mm_token_type_ids": mm_types,
        }
    if arch == "mllama":
        ids, labels = _ids(1, generator)
        seq = ids.shape[1]
        return {
            "input_ids": ids,
            "labels": labels,
            # (batch, images, tiles, channels, height, width): one image of 2 tiles (1x2).
            "pixel_values": torch.randn(BATCH, 1, 2, 3, 28, 28, generator=generator),
            "aspect_ratio_ids": torch.full((BATCH, 1), 2),
            "aspect_ratio_mask": torch.ones(BATCH, 1, 2, dtype=torch.long),
            "cross_attention_mask": torch.ones(BATCH, seq, 1, 2, dtype=torch.long),
        }
    if arch == "gemma3":
        ids, labels = _ids(4, generator)
        return {
            "input_ids": ids,
            "labels": labels,
            "pixel_values": torch.randn(BATCH, 3, 28, 28, generator=generator),
            "token_type_ids": (ids == IMAGE).long(),
        }
    raise ValueError(f"unknown arch {arch!r}; one of {ARCHS}")
