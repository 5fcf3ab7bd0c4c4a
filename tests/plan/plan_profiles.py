"""Synthetic model and hardware profiles for the planner tests (no GPU, no real model)."""

from __future__ import annotations

import random

from autooffload.plan.profile_types import (
    ChunkProfile,
    HardwareProfile,
    ModelProfile,
    UnitProfile,
)

MiB = 1 << 20


def layout_chunks(
    tensors_per_unit: list[list[tuple[int, bool]]], chunk_size: int
) -> tuple[ChunkProfile, ...]:
    """Pack (bytes, trainable) tensors into chunks in execution order, as the runtime does (a
    tensor larger than ``chunk_size`` alone in a chunk of its size)."""
    chunks: list[dict] = []
    for unit, tensors in enumerate(tensors_per_unit):
        for size, trainable in tensors:
            if not chunks or chunks[-1]["bytes"] + size > chunk_size:
                chunks.append({"bytes": 0, "trainable_bytes": 0, "units": set()})
            chunks[-1]["bytes"] += size
            chunks[-1]["trainable_bytes"] += size if trainable else 0
            chunks[-1]["units"].add(unit)
    return tuple(
        ChunkProfile(
            bytes=c["bytes"],
            trainable_bytes=c["trainable_bytes"],
            trainable_numel=c["trainable_bytes"] // 2,
            units=tuple(sorted(c["units"])),
        )
        for c in chunks
    )


def make_profile(
    n_blocks: int = 4,
    chunk_size: int = 64 * MiB,
    block_param_bytes: int = 96 * MiB,
    tensors_per_block: int = 4,
    seed: int | None = None,
    lora: bool = False,
    tied: bool = False,
    fwd_s: float = 0.02,
    edge_bytes: int | None = None,
) -> ModelProfile:
    """A decoder-like model: embeddings, ``n_blocks`` equal blocks, head; bf16 weights.

    With ``seed`` the per-block times and sizes vary randomly (for brute-force comparisons).
    ``edge_bytes``: the embedding's and the head's size (default two block tensors); above
    ``chunk_size`` each gets a chunk of its own, as an unquantized vocabulary beside nf4 blocks.
    """
    rng = random.Random(seed)

    def jitter(value: float) -> float:
        return value * (rng.uniform(0.5, 1.5) if seed is not None else 1.0)

    tensor = block_param_bytes // tensors_per_block
    edge = edge_bytes if edge_bytes is not None else 2 * tensor
    tensors: list[list[tuple[int, bool]]] = [[(edge, not lora)]]
    for _ in range(n_blocks):
        tensors.append([(int(jitter(tensor)), not lora) for _ in range(tensors_per_block)])
    tensors.append([] if tied else [(edge, not lora)])
    chunks = layout_chunks(tensors, chunk_size)
    if tied:
        first = chunks[0]
        chunks = (
            ChunkProfile(
                first.bytes,
                first.trainable_bytes,
                first.trainable_numel,
                (*first.units, n_blocks + 1),
            ),
            *chunks[1:],
        )

    def unit(name: str, scale: float = 1.0) -> UnitProfile:
        keep = int(jitter(48 * MiB) * scale)
        return UnitProfile(
            fwd_s=jitter(fwd_s) * scale,
            bwd_s=jitter(2 * fwd_s) * scale,
            act_bytes_keep=keep,
            act_bytes_checkpoint=keep // 8,
            fwd_transient_bytes=int(jitter(16 * MiB) * scale),
            bwd_transient_bytes=int(jitter(24 * MiB) * scale),
            name=name,
        )

    blocks = tuple(unit(f"block{j}") for j in range(n_blocks))
    return ModelProfile(
        chunk_size=chunk_size,
        chunks=chunks,
        blocks=blocks,
        pre=unit("pre", 0.25),
        post=unit("post", 2.0),
        batch_tokens=4096,
        static_bytes=8 * MiB,
        other_s=0.001,
        optim_bytes_per_param=4,
    )


def make_hardware(**overrides) -> HardwareProfile:
    """An H100 machine as measure_hardware saw one (55 GB/s each way, 96 GB/s both at once,
    fused AdamW ~5-7 Gparam/s on 16 CPU cores, ~67 Gparam/s bf16 on the GPU, 0.7 GB context)."""
    values = dict(
        h2d_bps=55e9,
        d2h_bps=55e9,
        duplex_bps=96e9,
        cpu_optim_params_per_s=5e9,
        gpu_optim_params_per_s=67e9,
        gpu_free_bytes=79 << 30,
        gpu_total_bytes=80 << 30,
        cuda_context_bytes=512 * MiB,
        device_name="synthetic",
    )
    values.update(overrides)
    return HardwareProfile(**values)


def llama8b_lora_profile(nf4: bool = False, served: bool = True) -> ModelProfile:
    """Llama-3-8B under LoRA r16 at bs 1, seq 256 (QLoRA with ``nf4``), as the profiling steps
    would measure it with the frozen vocabulary served from the host (``served``): 32 frozen
    blocks of 436 MB (110 MB nf4), a 1.05 GB bf16 embedding and head; adapters and their AdamW
    state resident (static). Activations from the shapes: a block keeps ~164 KB per token and
    checkpoints its 2 MB input; the post unit keeps the bf16 logits (66 MB), and the chunked
    loss's fp32 rows (~4 x 131 MB) are its transients. Times are rough H100 figures."""
    tokens, hidden, vocab = 256, 4096, 128256
    vocab_bytes = vocab * hidden * 2
    block_bytes = 110_000_000 if nf4 else 436_224_000
    tile_bytes = 2 * (64 << 20)
    chunks = [
        ChunkProfile(
            vocab_bytes,
            units=(0,),
            backward=False,
            served=served,
            served_fwd_bytes=tokens * hidden * 2 if served else 0,
        )
    ]
    chunks += [ChunkProfile(block_bytes, units=(j + 1,)) for j in range(32)]
    chunks.append(
        ChunkProfile(
            vocab_bytes,
            units=(33,),
            served=served,
            served_fwd_bytes=vocab_bytes if served else 0,
            served_bwd_bytes=vocab_bytes if served else 0,
            served_device_bytes=tile_bytes if served else 0,
        )
    )
    block = UnitProfile(
        fwd_s=0.004 if nf4 else 0.003,
        bwd_s=0.008 if nf4 else 0.006,
        act_bytes_keep=tokens * 164_000,
        act_bytes_checkpoint=tokens * hidden * 2,
        fwd_transient_bytes=tokens * 14336 * 2 * 2,
        bwd_transient_bytes=tokens * 14336 * 2 * 3,
        name="block",
    )
    logits = tokens * vocab * 2
    head_s = vocab_bytes / 50e9 if served else 0.001
    post = UnitProfile(
        fwd_s=head_s,
        bwd_s=head_s,
        act_bytes_keep=logits,
        fwd_transient_bytes=4 * 2 * logits + (tile_bytes if served else 0),
        bwd_transient_bytes=4 * 2 * logits + (tile_bytes if served else 0),
        name="post",
    )
    pre = UnitProfile(fwd_s=0.001, bwd_s=0.0, act_bytes_keep=tokens * hidden * 2, name="pre")
    return ModelProfile(
        chunk_size=block_bytes,
        chunks=tuple(chunks),
        blocks=(block,) * 32,
        pre=pre,
        post=post,
        batch_tokens=tokens,
        static_bytes=340 * MiB,
        other_s=0.002,
        optim_bytes_per_param=4,
        weight_dtype="nf4" if nf4 else "bfloat16",
        expandable_segments=True,
    )
