"""Model FLOPs utilisation (MFU) of a bench run: the model's FLOPs per token from the workload's
dims, and the GPU's peak dense bf16 rate by name.

MFU = tokens/s per GPU x model FLOPs per token / the GPU's peak dense bf16 FLOPs/s.

Model FLOPs, not hardware FLOPs: what the training step must compute, whatever the peer does to
fit (gradient checkpointing's recomputed forward is not counted, nor is any copy). Per token, for
a Llama decoder of ``L`` layers:

- matmul weights: ``N`` counts the weights of every block's linears (q, k, v, o, gate, up,
  down) and the LM head (counted once when tied to the input embedding); the input embedding is
  a lookup and the norms are element-wise, so neither counts.
- full fine-tuning: ``6 N`` (forward ``2 N``, backward ``4 N``: input and weight gradients).
- LoRA and QLoRA (the base frozen): ``4 N`` (forward ``2 N``, backward the input gradients
  ``2 N``, no weight gradients) plus ``6 A`` for the ``A`` adapter parameters (their forward,
  input and weight gradients). QLoRA's nf4 base costs as much: its weights are dequantised to
  bf16 for the same matmuls.
- attention, causal convention: per layer the forward's ``QK^T`` and ``PV`` take
  ``2 x 2 x seq x (num_heads x head_dim)`` FLOPs per token without the mask, half of it under the
  causal mask (each token attends to ``seq / 2`` keys on average): ``2 x seq x num_heads x
  head_dim``; the backward twice that, so ``3x`` for forward and backward:
  ``6 x L x seq x num_heads x head_dim`` per token.

Other architectures (Qwen2-VL's vision tower) are not counted: their runs have no MFU.
"""

from __future__ import annotations

from typing import Any

# Peak dense (not sparse) bf16 tensor-core FLOPs/s from the vendors' datasheets, matched against
# ``torch.cuda.get_device_name()`` in order, first match wins. None: a variant of a listed GPU
# with another peak (PCIe / NVL boards run lower clocks), so no MFU rather than a wrong one.
PEAK_BF16_FLOPS: tuple[tuple[str, float | None], ...] = (
    ("H100 PCIe", None),
    ("H100 NVL", None),
    ("H100", 989e12),  # H100 SXM5 ("NVIDIA H100 80GB HBM3")
    ("H200 NVL", None),
    ("H200", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("RTX 4090", 165e12),
)


def peak_flops(device_name: str | None) -> float | None:
    """The peak dense bf16 FLOPs/s of the GPU named ``device_name``; None when unknown."""
    if not device_name:
        return None
    for pattern, flops in PEAK_BF16_FLOPS:
        if pattern.lower() in device_name.lower():
            return flops
    return None


def model_flops_per_token(workload: Any) -> float | None:
    """Model FLOPs of one training token (forward and backward) of ``workload`` (module
    docstring); None for architectures other than Llama."""
    if workload.arch != "llama":
        return None
    d = workload.text_dims
    h, inter, layers = d["hidden_size"], d["intermediate_size"], d["num_hidden_layers"]
    heads = d["num_attention_heads"]
    head_dim = d.get("head_dim") or h // heads
    q = heads * head_dim
    kv = d["num_key_value_heads"] * head_dim
    # (in, out) of the block's linears, in module order.
    linears = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }
    block = sum(fan_in * fan_out for fan_in, fan_out in linears.values())
    matmul_params = layers * block + d["vocab_size"] * h  # + the LM head
    attention = 6 * layers * workload.seq * q  # causal: fwd 2*2*seq*q*0.5, x3 with the bwd
    if workload.mode == "full":
        return 6 * matmul_params + attention
    adapters = layers * sum(
        workload.lora_r * (fan_in + fan_out)
        for name, (fan_in, fan_out) in linears.items()
        if name in workload.lora_targets
    )
    return 4 * matmul_params + 6 * adapters + attention


def mfu(workload: Any, tokens_per_s_per_gpu: float, device_name: str | None) -> dict[str, Any]:
    """What a run records: ``model_flops_per_token``, ``peak_flops`` (the GPU's) and ``mfu``
    (a fraction; None without a known peak or FLOPs count)."""
    per_token = model_flops_per_token(workload)
    peak = peak_flops(device_name)
    value = None
    if per_token is not None and peak and tokens_per_s_per_gpu:
        value = tokens_per_s_per_gpu * per_token / peak
    return {"model_flops_per_token": per_token, "peak_flops": peak, "mfu": value}
