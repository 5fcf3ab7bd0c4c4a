"""CUDA kernels by family, from their names in a torch.profiler trace (shared by dev tools)."""

from __future__ import annotations

# First match wins: a name's lowercased text containing the key belongs to the family.
FAMILIES = (
    ("memcpy htod", "copy H2D"),
    ("memcpy dtoh", "copy D2H"),
    ("memcpy dtod", "copy D2D"),
    ("memset", "memset"),
    ("nccl", "nccl"),
    ("gemm", "gemm"),
    ("nvjet", "gemm"),
    ("cutlass", "gemm"),
    ("flash", "attention"),
    ("fmha", "attention"),
    ("sdpa", "attention"),
    ("adam", "optimizer"),
    ("multi_tensor", "optimizer"),
    ("reduce", "reduce"),
    ("copy", "copy/cast kernel"),
    ("cat", "cat"),
    ("softmax", "softmax"),
    ("elementwise", "elementwise"),
    ("vectorized", "elementwise"),
)


def family(name: str) -> str:
    """The family of the kernel called ``name``; "other" where no key matches."""
    lowered = name.lower()
    return next((fam for key, fam in FAMILIES if key in lowered), "other")
