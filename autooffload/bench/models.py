"""Build a workload's random-init model on the CPU (meta, then materialised per module) and batch.

Every peer builds the same model with the same seed, so losses can be compared across peers. The
model is built on the CPU and never needs twice its size in host memory: parameters are created
on the meta device (``accelerate.init_empty_weights``, buffers real), then materialised one module
at a time from a seeded pool of normal values (fast: a copy, not an RNG call per weight). For
QLoRA each block is materialised in bf16 and its ``nn.Linear`` layers replaced by
``bitsandbytes.nn.Linear4bit`` (nf4, double quantisation) right away, so the bf16 copy of at most
one block exists at a time. Quantisation runs on CUDA when available (then the 4-bit weights are
moved back to the CPU, so every peer starts from a CPU model and calls ``model.to(device)``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autooffload.bench.workloads import Workload
from autooffload.optional import import_bitsandbytes

POOL_NUMEL = 4_194_301  # prime, so the pool's period never lines up with a weight's rows
IMAGE_TOKEN_LABEL = -100


class _NormalPool:
    """Deterministic N(0, std) fill from one seeded pool of values (same on every device)."""

    def __init__(self, seed: int, std: float) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.pool = torch.randn(POOL_NUMEL, generator=generator).mul_(std)
        self.calls = 0

    def fill_(self, tensor: torch.Tensor) -> None:
        flat = tensor.view(-1)
        start = (self.calls * 7919) % (POOL_NUMEL // 2)
        self.calls += 1
        pos, total = 0, flat.numel()
        while pos < total:
            take = min(total - pos, POOL_NUMEL - start)
            flat[pos : pos + take].copy_(self.pool[start : start + take])
            pos += take
            start = 0


def _materialise(module: nn.Module, pool: _NormalPool, dtype: torch.dtype, memo: dict) -> None:
    """Replace the meta parameters directly owned by ``module`` with initialised CPU tensors."""
    is_norm = "norm" in type(module).__name__.lower()
    for name, param in list(module._parameters.items()):
        if param is None or param.device.type != "meta":
            continue
        if id(param) in memo:  # tied weights stay tied
            module._parameters[name] = memo[id(param)]
            continue
        value = torch.empty(param.shape, dtype=dtype)
        if name == "bias":
            value.zero_()
        elif is_norm:
            value.fill_(1.0)
        else:
            pool.fill_(value)
        new = nn.Parameter(value, requires_grad=param.requires_grad)
        memo[id(param)] = new
        module._parameters[name] = new


def _quantise_linears(block: nn.Module, quant_device: str, dtype: torch.dtype) -> None:
    """Swap every ``nn.Linear`` in ``block`` for a ``bnb.nn.Linear4bit`` (nf4, double quant)."""
    bnb = import_bitsandbytes()

    for name, child in list(block.named_modules()):
        if not isinstance(child, nn.Linear) or isinstance(child, bnb.nn.Linear4bit):
            continue
        parent = block.get_submodule(name.rsplit(".", 1)[0]) if "." in name else block
        q = bnb.nn.Linear4bit(
            child.in_features,
            child.out_features,
            bias=child.bias is not None,
            compute_dtype=dtype,
            compress_statistics=True,
            quant_type="nf4",
            quant_storage=torch.uint8,
            device="meta",
        )
        weight = bnb.nn.Params4bit(
            child.weight.data,
            requires_grad=False,
            compress_statistics=True,
            quant_type="nf4",
            quant_storage=torch.uint8,
            module=q,
        )
        weight = weight._quantize(torch.device(quant_device))
        if quant_device != "cpu":
            weight = weight.to("cpu")
        q.weight = weight
        q.quant_state = weight.quant_state
        if child.bias is not None:
            q.bias = nn.Parameter(child.bias.data, requires_grad=False)
        setattr(parent, name.rsplit(".", 1)[-1], q)


def _config(workload: Workload) -> Any:
    if workload.arch == "llama":
        from transformers import LlamaConfig

        dims = dict(workload.text_dims)
        return LlamaConfig(max_position_embeddings=max(4096, workload.seq), use_cache=False, **dims)
    if workload.arch == "qwen2vl":
        from transformers import Qwen2VLConfig

        text = dict(workload.text_dims, max_position_embeddings=max(32768, workload.seq))
        head_dim = text["hidden_size"] // text["num_attention_heads"]
        # Qwen2-VL-7B splits the rotary half-dim 64 as 16/24/24; scale for other head dims.
        half = head_dim // 2
        t = half // 4
        section = [t, (half - t) // 2, half - t - (half - t) // 2]
        text["rope_scaling"] = {"type": "mrope", "mrope_section": section}
        text["use_cache"] = False
        return Qwen2VLConfig(text_config=text, vision_config=dict(workload.vision_dims))
    raise ValueError(f"unknown arch {workload.arch!r} in workload {workload.name}")


def _decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks named in ``_no_split_modules`` (decoder layers, ViT blocks)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def build_model(workload: Workload, seed: int = 0, quant_device: str | None = None) -> nn.Module:
    """The workload's random-init model on the CPU, with LoRA / nf4 / checkpointing as specified."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, Qwen2VLForConditionalGeneration

    dtype = getattr(torch, workload.dtype)
    config = _config(workload)
    with init_empty_weights(include_buffers=False):
        if workload.arch == "qwen2vl":
            model = Qwen2VLForConditionalGeneration._from_config(config, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()  # construction under init_empty_weights leaves them untied
    init_std = getattr(config, "initializer_range", 0.02)
    pool = _NormalPool(seed, init_std)
    memo: dict[int, nn.Parameter] = {}
    if workload.mode == "qlora":
        quant_device = quant_device or ("cuda" if torch.cuda.is_available() else "cpu")
        for block in _decoder_blocks(model):
            if "vision" in type(block).__name__.lower():
                continue
            for module in block.modules():
                _materialise(module, pool, torch.bfloat16, memo)
            _quantise_linears(block, quant_device, torch.bfloat16)
        model.is_loaded_in_4bit = True  # PEFT dispatches its bnb LoRA layers on this flag
    for module in model.modules():
        _materialise(module, pool, dtype, memo)
    model.train()
    if workload.gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if workload.mode in ("lora", "qlora"):
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed)  # LoRA A init draws from the global RNG
        lora = LoraConfig(
            r=workload.lora_r,
            lora_alpha=workload.lora_alpha,
            lora_dropout=0.0,
            target_modules=list(workload.lora_targets),
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora)
        if workload.gc:
            model.enable_input_require_grads()
    return model


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper (or ``model`` itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model`` (PEFT-wrapped or not), outermost first, for sharding."""
    return _decoder_blocks(base_model(model))


def make_batch(workload: Workload, seed: int = 0) -> dict[str, torch.Tensor]:
    """One fixed CPU batch (same for every peer): random tokens, labels = inputs; images for VLMs.

    Training repeats this batch every step, so the loss falls steadily and peers that drop
    updates show up in the loss check.
    """
    generator = torch.Generator().manual_seed(seed + 1)
    vocab = workload.text_dims["vocab_size"]
    if workload.arch != "qwen2vl":
        ids = torch.randint(0, vocab, (workload.bs, workload.seq), generator=generator)
        return {"input_ids": ids, "labels": ids.clone()}
    return _vlm_batch(workload, generator)


def _vlm_batch(workload: Workload, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Qwen2-VL batch: per sample <vision_start> <image_pad> x N <vision_end> then text tokens."""
    from transformers import Qwen2VLConfig

    v = workload.vision_dims
    cfg = Qwen2VLConfig()
    grid = workload.image_px // v["patch_size"]
    n_image_tokens = grid * grid // (v["spatial_merge_size"] ** 2)
    n_text = workload.seq - n_image_tokens - 2
    if n_text < 1:
        raise ValueError(
            f"seq {workload.seq} is too short for a {workload.image_px}px image "
            f"({n_image_tokens} image tokens); use --seq >= {n_image_tokens + 3}"
        )
    text = torch.randint(0, 151643, (workload.bs, n_text), generator=generator)
    image = torch.full((workload.bs, n_image_tokens), cfg.image_token_id)
    start = torch.full((workload.bs, 1), cfg.vision_start_token_id)
    end = torch.full((workload.bs, 1), cfg.vision_end_token_id)
    ids = torch.cat([start, image, end, text], dim=1)
    labels = ids.clone()
    labels[:, : n_image_tokens + 2] = IMAGE_TOKEN_LABEL
    patch_dim = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2
    pixel_values = torch.randn(workload.bs * grid * grid, patch_dim, generator=generator)
    mm_types = torch.zeros_like(ids)
    mm_types[:, 1 : n_image_tokens + 1] = 1
    return {
        "input_ids": ids,
        "labels": labels,
        "pixel_values": pixel_values,
        "image_grid_thw": torch.tensor([[1, grid, grid]] * workload.bs),
        "mm_token_type_ids": mm_types,
    }


def accepted_batch(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``batch`` minus keys the model's forward does not take (older transformers versions)."""
    import inspect

    params = inspect.signature(base_model(model).forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        keep = set(batch) - ({"mm_token_type_ids"} - set(params))
    else:
        keep = set(batch) & set(params)
    return {k: v for k, v in batch.items() if k in keep}
