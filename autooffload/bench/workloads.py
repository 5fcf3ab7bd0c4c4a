"""The named benchmark workloads: model shapes (real dims of public models) and training modes."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

# Llama-architecture shapes. Dims are copied from the public configs of the named models; the
# weights are random (nothing is downloaded).
TINYLLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    vocab_size=32000,
    tie_word_embeddings=False,
)
LLAMA32_3B = dict(
    hidden_size=3072,
    intermediate_size=8192,
    num_hidden_layers=28,
    num_attention_heads=24,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=True,
)
# "3.6B": the Llama-3.2-3B shape with its LM head untied (3.21B tied, 3.61B untied).
LLAMA32_3B_UNTIED = dict(LLAMA32_3B, tie_word_embeddings=False)
LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=False,
)
# Qwen2.5-14B / Qwen2.5-32B-like dims on the Llama architecture (no qkv bias).
QWEN25_14B_LIKE = dict(
    hidden_size=5120,
    intermediate_size=13824,
    num_hidden_layers=48,
    num_attention_heads=40,
    num_key_value_heads=8,
    vocab_size=152064,
    tie_word_embeddings=False,
)
QWEN25_32B_LIKE = dict(QWEN25_14B_LIKE, intermediate_size=27648, num_hidden_layers=64)
# 27.1B: the 32B-like blocks, 55 of them, with a 32k vocabulary (54 GB in bf16).
LLAMA_27B_LIKE = dict(QWEN25_32B_LIKE, num_hidden_layers=55, vocab_size=32000)
LLAMA_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    tie_word_embeddings=False,
)

# Qwen2-VL-7B-Instruct: text model and vision tower (675M-param ViT, 14 px patches, 2x2 merge).
QWEN2VL_7B_TEXT = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    tie_word_embeddings=False,
)
QWEN2VL_7B_VISION = dict(
    depth=32,
    embed_dim=1280,
    num_heads=16,
    mlp_ratio=4,
    hidden_size=3584,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    in_channels=3,
)
QWEN2VL_TINY_TEXT = dict(LLAMA_TINY, vocab_size=152064)
QWEN2VL_TINY_VISION = dict(QWEN2VL_7B_VISION, depth=2, embed_dim=32, num_heads=2, hidden_size=64)

# LoRA adapters are fp32, so a smaller lr still moves them; 1e-3 memorises the batch in 4 steps
# and leaves the loss check nothing to compare.
LORA_LR = 1e-4
LLAMA_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ParamTensor:
    """One parameter of a workload's model, as the bench builds it."""

    numel: int
    trainable: bool
    element_size: int
    """Bytes per element as built: the workload's dtype, 4 for LoRA adapters (fp32)."""


@dataclass(frozen=True)
class Workload:
    """One benchmark workload: a model shape, a training mode and a batch shape.

    ``mode`` is "full" (every parameter trained), "lora" (bf16 base frozen, LoRA adapters on
    ``lora_targets``) or "qlora" (base linear layers of the blocks in bitsandbytes nf4 with double
    quantisation, LoRA on top). ``arch`` is "llama" or "qwen2vl" (the latter takes one
    ``image_px`` x ``image_px`` image per sample).
    """

    name: str
    arch: str
    text_dims: dict[str, Any]
    mode: str
    bs: int
    seq: int
    gc: bool
    dtype: str = "bfloat16"
    vision_dims: dict[str, Any] = field(default_factory=dict)
    image_px: int = 448
    lora_r: int = 16
    lora_alpha: int = 32
    lora_targets: tuple[str, ...] = LLAMA_LORA_TARGETS
    lr: float = 1e-3
    description: str = ""
    autooffload_defaults: dict[str, Any] = field(default_factory=dict)
    cpu_only: bool = False
    accum: int = 1
    """Micro-batches per optimizer step (gradient accumulation; each of ``bs`` x ``seq``)."""

    @property
    def tokens_per_step(self) -> int:
        return self.bs * self.seq * self.accum

    def approx_params(self) -> int:
        """Approximate parameter count of the base model (for dry runs and memory estimates)."""
        d = self.text_dims
        h, i, n = d["hidden_size"], d["intermediate_size"], d["num_hidden_layers"]
        head_dim = h // d["num_attention_heads"]
        kv = d["num_key_value_heads"] * head_dim
        per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
        embed = d["vocab_size"] * h * (1 if d.get("tie_word_embeddings") else 2)
        vision = 0
        if self.vision_dims:
            v = self.vision_dims
            e = v["embed_dim"]
            vision = v["depth"] * (4 * e * e + 2 * e * e * v["mlp_ratio"]) + 4 * e * e * 4
        return n * per_layer + embed + vision

    def parameter_tensors(self) -> list[ParamTensor] | None:
        """Every parameter of the model the bench builds, in ``model.parameters()`` order,
        computed from the dims (nothing is built); None for other architectures and QLoRA."""
        if self.arch != "llama" or self.mode == "qlora":
            return None
        d = self.text_dims
        h, i, vocab = d["hidden_size"], d["intermediate_size"], d["vocab_size"]
        kv = d["num_key_value_heads"] * (h // d["num_attention_heads"])
        base = 2 if self.dtype in ("bfloat16", "float16") else 4
        lora = self.mode == "lora"
        full = self.mode == "full"
        # (name, in_features, out_features) of the block's linears, in module order.
        linears = (
            ("q_proj", h, h),
            ("k_proj", h, kv),
            ("v_proj", h, kv),
            ("o_proj", h, h),
            ("gate_proj", h, i),
            ("up_proj", h, i),
            ("down_proj", i, h),
        )
        tensors = [ParamTensor(vocab * h, full, base)]
        for _ in range(d["num_hidden_layers"]):
            for name, fan_in, fan_out in linears:
                tensors.append(ParamTensor(fan_in * fan_out, full, base))
                if lora and name in self.lora_targets:
                    # PEFT's lora_A (r x in) and lora_B (out x r), kept in fp32.
                    tensors.append(ParamTensor(self.lora_r * fan_in, True, 4))
                    tensors.append(ParamTensor(fan_out * self.lora_r, True, 4))
            tensors += [ParamTensor(h, full, base), ParamTensor(h, full, base)]  # the two norms
        tensors.append(ParamTensor(h, full, base))  # the final norm
        if not d.get("tie_word_embeddings"):
            tensors.append(ParamTensor(vocab * h, full, base))
        return tensors

    def describe(self) -> str:
        params = self.approx_params()
        size = f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.2f}M"
        gc = "gc" if self.gc else "no-gc"
        accum = f" accum {self.accum}" if self.accum > 1 else ""
        named = WORKLOADS.get(self.name)
        layers = self.text_dims["num_hidden_layers"]
        depth = (
            f" {layers} layers" if named is not None and named.text_dims != self.text_dims else ""
        )
        return (
            f"{self.name}{depth}: ~{size} params, {self.mode}, bs {self.bs} seq {self.seq}"
            f"{accum} {gc}"
        )


def _w(**kwargs: Any) -> Workload:
    return Workload(**kwargs)


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        _w(
            name="llama-tiny",
            arch="llama",
            text_dims=LLAMA_TINY,
            mode="full",
            bs=2,
            seq=32,
            gc=False,
            dtype="float32",
            description="2-layer hidden-64 Llama for CPU tests (fp32 so peers agree tightly)",
            autooffload_defaults={"force_attach": True},
            cpu_only=True,
        ),
        _w(
            name="llama-tiny-lora",
            arch="llama",
            text_dims=LLAMA_TINY,
            mode="lora",
            bs=2,
            seq=32,
            gc=True,
            dtype="float32",
            description="tiny Llama with LoRA on all block linears (CPU tests)",
            autooffload_defaults={"force_attach": True},
            cpu_only=True,
        ),
        _w(
            name="llama-tiny-qlora",
            arch="llama",
            text_dims=LLAMA_TINY,
            mode="qlora",
            bs=2,
            seq=32,
            gc=True,
            description="tiny Llama, nf4 base + LoRA (tests the quantisation path)",
            autooffload_defaults={"force_attach": True},
            cpu_only=True,
        ),
        _w(
            name="qwen2vl-tiny-lora",
            arch="qwen2vl",
            text_dims=QWEN2VL_TINY_TEXT,
            vision_dims=QWEN2VL_TINY_VISION,
            mode="lora",
            bs=1,
            seq=96,
            gc=False,
            image_px=224,
            dtype="float32",
            description="tiny Qwen2-VL with one 224x224 image per sample (CPU tests)",
            autooffload_defaults={"force_attach": True},
            cpu_only=True,
        ),
        _w(
            name="llama-1b-full",
            arch="llama",
            text_dims=TINYLLAMA_1B,
            mode="full",
            bs=4,
            seq=1024,
            gc=False,
            description="TinyLlama-1.1B dims, full fine-tuning, bf16, AdamW",
        ),
        _w(
            name="llama-3b-full",
            arch="llama",
            text_dims=LLAMA32_3B,
            mode="full",
            bs=4,
            seq=1024,
            gc=True,
            description="Llama-3.2-3B dims (tied embeddings), full fine-tuning, bf16, AdamW, gc",
        ),
        _w(
            name="llama-3.6b-full",
            arch="llama",
            text_dims=LLAMA32_3B_UNTIED,
            mode="full",
            bs=4,
            seq=1024,
            gc=True,
            description="Llama-3.2-3B dims, untied LM head (3.6B), full fine-tuning, bf16, gc",
        ),
        _w(
            name="llama-8b-full",
            arch="llama",
            text_dims=LLAMA3_8B,
            mode="full",
            bs=4,
            seq=1024,
            gc=True,
            description="Llama-3-8B dims, full fine-tuning, bf16, AdamW, gc (multi-GPU bench)",
        ),
        _w(
            name="llama-8b-lora",
            lr=LORA_LR,
            arch="llama",
            text_dims=LLAMA3_8B,
            mode="lora",
            bs=4,
            seq=1024,
            gc=True,
            description="Llama-3-8B dims, bf16 base, LoRA r16 a32 on all block linears, gc",
        ),
        _w(
            name="llama-8b-qlora",
            lr=LORA_LR,
            arch="llama",
            text_dims=LLAMA3_8B,
            mode="qlora",
            bs=4,
            seq=1024,
            gc=True,
            description="Llama-3-8B dims, nf4 double-quant base, LoRA r16 a32, gc",
        ),
        _w(
            name="llama-8b-lora-long",
            lr=LORA_LR,
            arch="llama",
            text_dims=LLAMA3_8B,
            mode="lora",
            bs=1,
            seq=16384,
            gc=True,
            description="Llama-3-8B dims, LoRA, one 16k-token sequence, gc",
        ),
        _w(
            name="qwen2vl-7b-lora",
            lr=LORA_LR,
            arch="qwen2vl",
            text_dims=QWEN2VL_7B_TEXT,
            vision_dims=QWEN2VL_7B_VISION,
            mode="lora",
            bs=4,
            seq=1024,
            gc=True,
            description="Qwen2-VL-7B dims, one 448x448 image (256 tokens) per sample, LoRA, gc",
        ),
        _w(
            name="llama-14b-lora",
            lr=LORA_LR,
            arch="llama",
            text_dims=QWEN25_14B_LIKE,
            mode="lora",
            bs=4,
            seq=1024,
            gc=True,
            description="Qwen2.5-14B-like dims on Llama, bf16 base, LoRA r16, gc",
        ),
        _w(
            name="llama-27b-lora",
            lr=LORA_LR,
            arch="llama",
            text_dims=LLAMA_27B_LIKE,
            mode="lora",
            bs=4,
            seq=1024,
            gc=True,
            description="27B Llama shape (32B-like blocks x55, 32k vocab), bf16 base, LoRA r16, gc",
        ),
        _w(
            name="llama-32b-qlora",
            lr=LORA_LR,
            arch="llama",
            text_dims=QWEN25_32B_LIKE,
            mode="qlora",
            bs=4,
            seq=1024,
            gc=True,
            description="Qwen2.5-32B-like dims on Llama, nf4 double-quant base, LoRA r16, gc",
        ),
    ]
}


class UnknownNameError(ValueError):
    """A workload or peer name that the bench does not know."""


def get_workload(
    name: str,
    bs: int | None = None,
    seq: int | None = None,
    gc: bool | None = None,
    accum: int | None = None,
    layers: int | None = None,
) -> Workload:
    """The workload ``name`` with its batch size, sequence length, checkpointing, gradient
    accumulation or depth (``layers``: the text model's block count) overridden."""
    if name not in WORKLOADS:
        valid = ", ".join(WORKLOADS)
        raise UnknownNameError(f"unknown workload {name!r}; valid workloads: {valid}")
    workload = WORKLOADS[name]
    changes: dict[str, Any] = {}
    if bs is not None:
        changes["bs"] = bs
    if seq is not None:
        changes["seq"] = seq
    if gc is not None:
        changes["gc"] = gc
    if accum is not None:
        if accum < 1:
            raise ValueError(f"invalid accum {accum}: micro-batches per step must be >= 1")
        changes["accum"] = accum
    if layers is not None:
        if layers < 1:
            raise ValueError(f"invalid layers {layers}: the block count must be >= 1")
        changes["text_dims"] = dict(workload.text_dims, num_hidden_layers=layers)
    return replace(workload, **changes) if changes else workload


def workload_overrides(workload: Workload) -> dict[str, Any]:
    """The ``get_workload`` arguments that rebuild ``workload`` from its name (what a worker
    process is sent)."""
    return {
        "bs": workload.bs,
        "seq": workload.seq,
        "gc": workload.gc,
        "accum": workload.accum,
        "layers": workload.text_dims["num_hidden_layers"],
    }


def workload_to_dict(workload: Workload) -> dict[str, Any]:
    """A JSON-ready dict of ``workload`` (sent to workers and written to results)."""
    return {
        "name": workload.name,
        **workload_overrides(workload),
        "mode": workload.mode,
        "arch": workload.arch,
        "dtype": workload.dtype,
        "approx_params": workload.approx_params(),
    }
