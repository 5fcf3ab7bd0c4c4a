"""A configuration's knobs made concrete: their checks, block policies and profile variants.

The variants are those the search tries: the blocks' MLPs in token tiles, checkpoint inputs on
the host, and where gradient accumulation sums.

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
from autooffload.plan.profile_types import (
    PROBE_TILES,
    TILED_PEAK_PREFIXES,
    HardwareProfile,
    ModelProfile,
    UnitProfile,
)
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


def host_input_policies(policies: tuple[str, ...], host_blocks: int) -> tuple[str, ...]:
    """``policies`` with the checkpointed blocks from ``host_blocks`` on keeping their inputs on
    the device (``checkpoint``, not ``checkpoint_cpu``)."""
    return tuple(
        "checkpoint" if p == "checkpoint_cpu" and i >= host_blocks else p
        for i, p in enumerate(policies)
    )


def with_checkpoint_inputs_on_cpu(
    profile: ModelProfile, hw: HardwareProfile, blocks: int | None = None
) -> ModelProfile:
    """The layout's variant where a checkpointed block's one saved tensor, its input, is copied
    to host memory in the forward and prefetched back for its recompute (``checkpoint_cpu``):
    every block's, or the first ``blocks`` blocks' where the host holds no more (the later
    blocks' inputs, the ones the backward needs first, stay on the device; ``host_input_blocks``).

    For every such block ``u`` with input bytes ``c = act_bytes_checkpoint[u]``:
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
    n_host = profile.n_blocks if blocks is None else max(0, min(blocks, profile.n_blocks))
    units = []
    host_inputs = []
    for index, unit in enumerate(profile.blocks):
        if index >= n_host:
            units.append(unit)
            continue
        c = unit.act_bytes_checkpoint
        host_inputs.append(c)
        units.append(
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
        blocks=tuple(units),
        other_s=profile.other_s + sum(host_inputs) / hw.d2h_bps,
        checkpoint_inputs_on_cpu=True,
        host_input_blocks=n_host,
        host_input_bytes=tuple(host_inputs),
    )


def host_activation_bytes(profile: ModelProfile, n_swap: int, n_checkpoint: int) -> int:
    """Host bytes a configuration's activations take at the end of the forward: every swapped
    block's saved tensors (``act_bytes_keep``; blocks ``[0, n_swap)``) and the input of every
    checkpointed block that keeps it on the host (``host_input_bytes``; blocks
    ``[n_swap, n_swap + n_checkpoint)`` among the first ``host_input_blocks``), pinned memory
    the search bounds by what the host has room for (``SearchRequest.host_room``)."""
    swapped = sum(unit.act_bytes_keep for unit in profile.blocks[:n_swap])
    return swapped + sum(profile.host_input_bytes[n_swap : n_swap + n_checkpoint])


def with_mlp_tiles(profile: ModelProfile, tile_tokens: int) -> ModelProfile:
    """The layout's variant where every block's MLP runs in tiles of ``tile_tokens`` tokens
    (``runtime/activations/tiled_mlp.py``): its forward saves only its input, its backward runs the
    forward again tile by tile. Apply it before ``with_checkpoint_inputs_on_cpu``.

    With T = ``batch_tokens``, r = min(1, tile_tokens / T), and per block with a tileable MLP
    (A = ``mlp_act_bytes``, its intermediates; F, B = ``mlp_fwd/bwd_transient_bytes``, the MLP's
    own peaks above A; X = ``act_bytes_checkpoint``, one hidden-sized tensor: the MLP's output
    in the forward, its input's gradient in the backward, both whole-sequence buffers):
      act_bytes_keep'  = act_bytes_keep - A                                            (bytes)
      fwd_transient'   = X + r * (A + max(F - X, 0))   if fwd_transient <= F           (bytes)
                       = fwd_transient + A             otherwise
      bwd_transient'   = X + r * (A + max(B - X, 0))   if bwd_transient <= B           (bytes)
                       = bwd_transient + A             otherwise
      bwd_s'           = bwd_s + mlp_fwd_s             (the backward's second MLP forward, s)
    The first case is a block whose peak lies in its MLP (its transient is no larger than the
    MLP's own): tiled, one tile's intermediates and their gradients live there. Otherwise the
    peak lies outside the MLP, where tiling changes no bytes: the same absolute peak, above a
    keep that is A smaller. Where the probe ran the block tiled (K, P_f, P_b =
    ``tiled_act_bytes_keep``, ``tiled_fwd/bwd_peak_bytes``; K > 0), what it measured wins, its
    peaks read at the plan's tile share r from those measured with 1/64, 1/16 and 1/4 of the
    batch in a tile (``PROBE_FINE_TILES``, ``PROBE_TILES``, ``PROBE_COARSE_TILES``; peaks
    p, P, q: ``tiled_fine_*``, ``tiled_*``, ``tiled_coarse_*``; ``_tiled_peak``), each first
    raised to those at smaller shares:
      act_bytes_keep'  = K       (a tiled norm saves its input, where an RMSNorm in bf16 saved
                                  an fp32 copy and let the input go: K can exceed keep - A)
      fwd_transient'   = p_f - K                                          r <= 1/64
                       = the chord through (1/64, p_f), (1/16, P_f), (1/4, q_f) at r, - K
                       = q_f + (r - 1/4) * (A + max(F - X, 0)) - K         r > 1/4
      bwd_transient'   likewise with p_b, P_b, q_b and B
    (a peak not measured drops out: a profile with P alone grows it from 1/16 and keeps it
    below).
    The measurement sees where the tiled block's peak lies (its attention's backward, once the
    MLP's is gone); the formulas' second case cannot: an untiled peak after the MLP holds its
    intermediates, which tiling removes (Llama 1.1B at 65536 tokens: 5.6 GiB by the formula
    for the forward, 2.1 measured).
    A checkpointed block's recompute materialises ``act_bytes_keep'``, so tiling shrinks its
    backward too; its recompute runs the tiled forward (no extra time).
    """
    if tile_tokens < 1:
        raise PlanError(f"mlp_tile_tokens={tile_tokens} is out of range; valid: >= 1 tokens")
    if profile.checkpoint_inputs_on_cpu:
        raise PlanError("with_mlp_tiles applies to a profile before with_checkpoint_inputs_on_cpu")
    share = min(1.0, tile_tokens / max(1, profile.batch_tokens))
    blocks = []
    for unit in profile.blocks:
        a = min(unit.mlp_act_bytes, unit.act_bytes_keep)
        if a <= 0:
            blocks.append(unit)
            continue
        x = unit.act_bytes_checkpoint

        own_f = max(unit.mlp_fwd_transient_bytes - x, 0)
        own_b = max(unit.mlp_bwd_transient_bytes - x, 0)
        if unit.tiled_act_bytes_keep > 0:  # measured by the probe in PROBE_TILES tiles
            keep = unit.tiled_act_bytes_keep
            fwd = _tiled_peak(share, _tiled_peaks(unit, "fwd"), a + own_f) - keep
            bwd = _tiled_peak(share, _tiled_peaks(unit, "bwd"), a + own_b) - keep
        else:
            keep = unit.act_bytes_keep - a
            in_mlp = unit.fwd_transient_bytes <= unit.mlp_fwd_transient_bytes
            fwd = int(x + share * (a + own_f)) if in_mlp else unit.fwd_transient_bytes + a
            in_mlp = unit.bwd_transient_bytes <= unit.mlp_bwd_transient_bytes
            bwd = int(x + share * (a + own_b)) if in_mlp else unit.bwd_transient_bytes + a
        blocks.append(
            replace(
                unit,
                act_bytes_keep=keep,
                fwd_transient_bytes=fwd,
                bwd_transient_bytes=bwd,
                bwd_s=unit.bwd_s + unit.mlp_fwd_s,
            )
        )
    return replace(profile, blocks=tuple(blocks), mlp_tile_tokens=tile_tokens)


def _tiled_peaks(unit: UnitProfile, side: str) -> tuple[tuple[int, int], ...]:
    """The probe's ``(tiles, peak)`` of ``unit``'s forward or backward (``side``) tiled."""
    return tuple(
        (tiles, getattr(unit, f"tiled_{prefix}{side}_peak_bytes"))
        for tiles, prefix in TILED_PEAK_PREFIXES
    )


def _tiled_peak(share: float, measured: tuple[tuple[int, int], ...], per_batch: int) -> int:
    """A tiled block's peak with tiles of ``share`` of the batch, from the probe's peaks
    ``measured`` as ``(tiles, peak)`` (one tile holding ``1 / tiles`` of the batch; a peak of 0:
    not measured). The peak is the larger of one in the MLP, rising with the tile by
    ``per_batch`` bytes per batch's worth (its intermediates and their gradients), and one
    elsewhere, flat: a convex, rising function of the share. Each measured peak is first raised
    to those at smaller shares (rising: noise cannot lower it). Between two measured shares: the
    chord, on or above the function; below the smallest: its peak; above the largest: its peak
    grown by ``per_batch`` for the larger tile."""
    points = sorted((1 / tiles, peak) for tiles, peak in measured if peak > 0)
    points = points or [(1 / PROBE_TILES, 0)]  # none above 0: the probe's own share's
    rising: list[tuple[float, int]] = []
    for at, peak in points:
        rising.append((at, max(peak, rising[-1][1]) if rising else peak))
    if share <= rising[0][0]:
        return rising[0][1]
    for (lo, low), (hi, high) in zip(rising, rising[1:]):
        if share <= hi:
            return low + int((share - lo) / (hi - lo) * (high - low))
    last, peak = rising[-1]
    return peak + int((share - last) * per_batch)


def with_served_chunks_gathered(profile: ModelProfile, hw: HardwareProfile) -> ModelProfile:
    """The layout's variant where the chunks the profile serves from the host
    (``ChunkProfile.served``: a frozen embedding's rows, a frozen head's tiles;
    ``runtime/host_vocab.py``) are gathered whole like any other chunk, persistent or streamed
    as the knobs say. For each served chunk, with F, B = ``served_fwd/bwd_bytes`` and
    D = ``served_device_bytes``, its unit u (the one using it) gets:
      fwd_s'[u]         = max(0, fwd_s[u] - F / h2d)        (the rows or tiles copied, s)
      bwd_s'[u]         = max(0, bwd_s[u] - B / h2d)
      fwd_transient'[u] = max(0, fwd_transient[u] - D)      (the tiles held, bytes)
      bwd_transient'[u] = max(-act_keep[u], bwd_transient[u] - D)   (if B > 0)
    and the chunk counts at its own bytes wherever the residency tables put it. The serving's
    copies wait for nothing and overlap nothing in the profiled step (an index on the host, a
    head's tiles one after another), so subtracting them at the link's rate is their time.
    """
    units = list(profile.units)
    chunks = []
    for chunk in profile.chunks:
        if not chunk.served:
            chunks.append(chunk)
            continue
        u = chunk.units[0]
        unit = units[u]
        device = chunk.served_device_bytes
        units[u] = replace(
            unit,
            fwd_s=max(0.0, unit.fwd_s - chunk.served_fwd_bytes / hw.h2d_bps),
            bwd_s=max(0.0, unit.bwd_s - chunk.served_bwd_bytes / hw.h2d_bps),
            fwd_transient_bytes=max(0, unit.fwd_transient_bytes - device),
            bwd_transient_bytes=(
                max(-unit.act_bytes_keep, unit.bwd_transient_bytes - device)
                if chunk.served_bwd_bytes
                else unit.bwd_transient_bytes
            ),
        )
        chunks.append(
            replace(
                chunk, served=False, served_fwd_bytes=0, served_bwd_bytes=0, served_device_bytes=0
            )
        )
    return replace(
        profile,
        chunks=tuple(chunks),
        pre=units[0],
        blocks=tuple(units[1:-1]),
        post=units[-1],
    )


def serves_chunks(profile: ModelProfile) -> bool:
    """Whether the profile serves any chunk from the host (``with_served_chunks_gathered``)."""
    return any(chunk.served for chunk in profile.chunks)


def has_tileable_mlp(profile: ModelProfile) -> bool:
    """Whether any block has an MLP whose tiling saves bytes (``with_mlp_tiles``)."""
    return any(unit.mlp_act_bytes > 0 for unit in profile.blocks)


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
