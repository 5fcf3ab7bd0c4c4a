"""A configuration's knobs made concrete: their checks, block policies and profile variants.

The variants are those the search tries: checkpoint inputs on the host, and where gradient
accumulation sums.

A configuration is a chunk layout (one ``ModelProfile``, i.e. one ``chunk_size``) plus
``Knobs(n_persist, n_buffer, n_swap, n_checkpoint)``. Units: bytes, seconds, bytes/s. Chunks have
their real sizes: a parameter larger than ``chunk_size`` has a chunk of its own size, and the
runtime sizes each chunk's device storage when it is gathered, so memory and traffic sum the
chunks actually on the device or on the link, never ``n_buffer * chunk_size``.
Notation: ``u`` is an execution unit (0 = pre, 1..L = blocks, L+1 = post, see ``profile_types``),
``p = n_persist`` (chunks ``0 .. p-1`` persistent, chunks ``>= p`` offloaded), ``b = n_buffer``.
docs/planner.md explains every term; ``plan.search`` evaluates the same formulas vectorised and
tests check both agree.
"""

from __future__ import annotations

from dataclasses import replace

from autooffload.errors import PlanError
from autooffload.plan.profile_types import HardwareProfile, ModelProfile
from autooffload.plan.residency import ChunkTables, chunk_tables
from autooffload.plan.types import Knobs, Plan


def accumulates_on_gpu(profile: ModelProfile) -> bool:
    """Whether the later micro-batches of gradient accumulation sum offloaded gradients on the
    GPU (``ModelProfile.accumulate_on`` "gpu"; "auto" reads as "cpu" outside the search)."""
    return profile.micro_batches > 1 and profile.accumulate_on == "gpu"


def with_accumulation_of(profile: ModelProfile, plan: Plan) -> ModelProfile:
    """``profile`` on "auto" pinned to where ``plan`` sums accumulated gradients: the variant
    the plan was predicted on."""
    if profile.accumulate_on != "auto":
        return profile
    return replace(profile, accumulate_on="gpu" if plan.accumulates_on_gpu else "cpu")


def assign_block_policies(
    n_blocks: int, n_swap: int, n_checkpoint: int, checkpoint: str = "checkpoint"
) -> tuple[str, ...]:
    """Per-block policy: blocks ``[0, n_swap)`` swap, the next ``n_checkpoint`` checkpoint (named
    ``checkpoint``: "checkpoint", or "checkpoint_cpu" with the inputs on the host), the rest keep.

    Why this order: a swapped block's activations leave during its forward and are needed back only
    at the very end of the backward, so the first blocks have the most time to hide both copies.
    Their swap-in traffic rides in the backward windows of the blocks just after them, so those are
    the ones checkpointed: their recompute lengthens exactly the windows where PCIe would stall.
    The last blocks keep (their backward comes first, with nothing to overlap a recompute with).
    The rule is nested: one more checkpoint only turns a keep block into a checkpoint block.
    """
    if min(n_swap, n_checkpoint) < 0 or n_swap + n_checkpoint > n_blocks:
        raise PlanError(
            f"n_swap={n_swap} + n_checkpoint={n_checkpoint} must be >= 0 and <= n_blocks={n_blocks}"
        )
    n_keep = n_blocks - n_swap - n_checkpoint
    return ("swap",) * n_swap + (checkpoint,) * n_checkpoint + ("keep",) * n_keep


def with_checkpoint_inputs_on_cpu(profile: ModelProfile, hw: HardwareProfile) -> ModelProfile:
    """The layout's variant where a checkpointed block's one saved tensor, its input, is copied
    to host memory in the forward and prefetched back for its recompute (``checkpoint_cpu``).

    For every block ``u`` with input bytes ``c = act_bytes_checkpoint[u]``:
      act_bytes_checkpoint'[u] = 0                    (nothing stays saved on the device)
      fwd_transient'[u]        = fwd_transient[u] + c  (the input while its copy-out runs)
      bwd_transient'[u]        = bwd_transient[u] + 2c (its input back, and the next one
                                                         prefetched)
      bwd_s'[u]                = bwd_s[u] + c / h2d    (the prefetch, charged unoverlapped)
      other_s'                 = other_s + sum(c) / d2h (the copy-outs, charged unoverlapped)
    Kept and swapped blocks get the same small surcharges (a few MiB and ~1 ms per block at most
    for an 8B model at 4k tokens), so the variant wins only where it really saves memory or
    recompute: the search runs both layouts and keeps the faster feasible plan.
    """
    blocks = []
    copied_out = 0
    for unit in profile.blocks:
        c = unit.act_bytes_checkpoint
        copied_out += c
        blocks.append(
            replace(
                unit,
                act_bytes_checkpoint=0,
                fwd_transient_bytes=unit.fwd_transient_bytes + c,
                bwd_transient_bytes=unit.bwd_transient_bytes + 2 * c,
                bwd_s=unit.bwd_s + c / hw.h2d_bps,
            )
        )
    return replace(
        profile,
        blocks=tuple(blocks),
        other_s=profile.other_s + copied_out / hw.d2h_bps,
        checkpoint_inputs_on_cpu=True,
    )


def unit_policies(n_blocks: int, n_swap: int, n_checkpoint: int) -> tuple[str, ...]:
    """Policies of all units: pre and post always keep."""
    return ("keep", *assign_block_policies(n_blocks, n_swap, n_checkpoint), "keep")


def check_knobs(profile: ModelProfile, knobs: Knobs, tables: ChunkTables | None = None) -> None:
    """Raise ``PlanError`` naming the knob if ``knobs`` is outside its valid range."""
    tables = tables or chunk_tables(profile)
    if not 0 <= knobs.n_persist <= profile.n_chunks:
        raise PlanError(
            f"n_persist={knobs.n_persist} is out of range; valid: 0..{profile.n_chunks} chunks"
        )
    min_buffers = int(tables.min_buffers[knobs.n_persist])
    if knobs.n_buffer < min_buffers:
        raise PlanError(
            f"n_buffer={knobs.n_buffer} is too small for n_persist={knobs.n_persist}: one unit"
            f" needs {min_buffers} offloaded chunks at once; valid: n_buffer >= {min_buffers}"
        )
    assign_block_policies(profile.n_blocks, knobs.n_swap, knobs.n_checkpoint)
