"""What the planner works from: the machine (HardwareProfile) and the model (ModelProfile).

Both are plain frozen dataclasses with ``to_dict`` / ``from_dict`` so they can be cached as JSON and
built by hand in tests. The runtime's profiler fills a ``ModelProfile``; ``plan.hardware`` fills a
``HardwareProfile``.

Execution units: the step is a sequence of ``n_units = n_blocks + 2`` units in forward order.
Unit 0 is the *pre* part (embeddings, a vision tower or anything before block 0), units
``1 .. n_blocks`` are the repeated blocks (block ``j`` is unit ``j + 1``), and unit
``n_blocks + 1`` is the *post* part (final norm, head, loss). Only blocks get an activation policy;
pre and post always keep their activations.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from autooffload.errors import PlanError

# Allocator fragmentation priors by weight dtype, used until ``calibration_model.calibrate`` has
# measured the real factor on this model (4-bit / 8-bit weights bring many small quant-state
# tensors).
DEFAULT_FRAGMENTATION: dict[str, float] = {
    "float32": 1.10,
    "bfloat16": 1.10,
    "float16": 1.10,
    "int8": 1.20,
    "nf4": 1.20,
    "fp4": 1.20,
}
FALLBACK_FRAGMENTATION = 1.20
# The prior under the allocator's expandable segments (runtime/allocator.py), whatever the
# dtype: freed pages are reused at any size, and what stays is the 2 MiB page rounding and the
# small-block pool (measured: 8B QLoRA at a 5 GiB cap, 4.86 GiB allocated in 5.01 reserved).
EXPANDABLE_FRAGMENTATION = 1.03

# The block probe runs a block's MLP and norms in this many tiles (``runtime/control/probe.py``)
# where its batch is longer than the smallest tile the search offers: ``UnitProfile.tiled_*``.
PROBE_TILES = 16
# And in this many and in this few, for the peaks of a plan whose tile holds a smaller share of
# the batch (8192 of 524288 tokens: 1/64) or a larger one (8192 of 65536: 1/8):
# ``UnitProfile.tiled_fine_*``, ``UnitProfile.tiled_coarse_*``.
PROBE_FINE_TILES = 64
PROBE_COARSE_TILES = 4


def need_from_peaks(allocated: float, reserved: float, expandable_segments: bool) -> float:
    """What a measured run needed in device memory, in the units of a predicted peak (the
    allocator's fragmentation included), from its allocated and reserved peaks.

    Under expandable segments this is ``allocated`` x ``EXPANDABLE_FRAGMENTATION``, not the
    reserved peak: the caching allocator maps new pages rather than wait for freed blocks still
    in use on another stream (likely: the host runs ahead of the copy streams) and gives its
    cache back only when an allocation would cross the cap (a retry), so the reserved peak
    grows to the cap every step whatever the plan needs. An 8B plan with 18.8 GiB allocated
    reserved 26 GiB under a 26 GiB cap and ran under a 19.5 GiB one (``devtools/cap_need.py``,
    BENCHMARKS.md). Without expandable segments the held segments fragment for real and
    ``reserved`` is the need."""
    return allocated * EXPANDABLE_FRAGMENTATION if expandable_segments else reserved


@dataclass(frozen=True)
class HardwareProfile:
    """Measured properties of one machine (GPU + host); see ``plan.hardware.measure_hardware``."""

    h2d_bps: float
    """Pinned host-to-device copy bandwidth, bytes/s, one direction alone."""
    d2h_bps: float
    """Device-to-pinned-host copy bandwidth, bytes/s, one direction alone."""
    duplex_bps: float
    """Aggregate bandwidth (H2D + D2H bytes per second) when both directions copy at once."""
    cpu_optim_params_per_s: float
    """CPU optimizer throughput, parameters updated per second (the optimizer class in use)."""
    gpu_optim_params_per_s: float
    """Device optimizer throughput for persistent parameters, parameters per second."""
    gpu_free_bytes: int
    """Free device memory when measured (refreshed on every ``measure_hardware`` call)."""
    gpu_total_bytes: int
    """Total device memory."""
    cuda_context_bytes: int
    """Device memory held by the CUDA context and library handles, outside the caching allocator."""
    device_name: str
    device_type: str = "cuda"
    """"cuda" or "cpu" (the CPU-simulation mode: copies are host memcpy, the device is host RAM)."""
    optimizer_name: str = ""
    """Optimizer class and variant (e.g. "AdamW(fused)") the optimizer rates were measured with."""
    cpu_threads: int = 0
    torch_version: str = ""
    driver_version: str = ""
    hostname: str = ""
    context_method: str = ""
    """How ``cuda_context_bytes`` was obtained ("nvml", "used_minus_reserved", "none")."""
    measure_s: float = 0.0
    """Wall seconds the measurement took."""
    allreduce_bps: float = math.inf
    """Data parallelism: bytes/s of the all-reduce that averages a persistent chunk's gradients
    in the backward (measured at attach with the real world size and chunk size); inf on one
    process. Not measured by ``measure_hardware``: ``DataParallel.effective_hardware`` sets it."""
    cpu_accumulate_params_per_s: float = math.inf
    """Gradient accumulation: offloaded gradient elements the CPU worker adds into the host
    gradients per second (a micro-batch's staged gradients onto the sum of the earlier ones);
    inf where unmeasured (no step accumulated yet: no cost). Not measured by
    ``measure_hardware``: the runtime times the adds of its profiling and planned steps."""

    def to_dict(self) -> dict[str, Any]:
        """As a dict for JSON: an unmeasured (infinite) rate as None."""
        data = asdict(self)
        for name in _UNMEASURED_INF:
            if not math.isfinite(data[name]):
                data[name] = None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareProfile:
        """Build from ``to_dict`` output; raises ``KeyError``/``TypeError`` on a malformed dict."""
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        for name in _UNMEASURED_INF:
            if name in kwargs and kwargs[name] is None:
                kwargs[name] = math.inf
        return cls(**kwargs)


# HardwareProfile rates that are infinite until measured (None in JSON).
_UNMEASURED_INF = ("allreduce_bps", "cpu_accumulate_params_per_s")


@dataclass(frozen=True)
class ChunkProfile:
    """One parameter chunk of the layout (chunks are in forward execution order)."""

    bytes: int
    """Bytes the chunk occupies on the device when resident; also what one H2D gather copies."""
    trainable_bytes: int = 0
    """Bytes of its trainable parameters: their gradients (and the D2H copy per step)."""
    trainable_numel: int = 0
    """Number of trainable elements: the optimizer's work and its state size."""
    units: tuple[int, ...] = ()
    """Execution units whose forward/backward use the chunk, ascending (see module docstring)."""
    backward: bool = True
    """Whether a backward reads it. False when no group using it has a backward through its
    weights (a frozen embedding): the runtime neither gathers nor prefetches it there."""
    served: bool = False
    """Served from the host store in this profile (``runtime/host_vocab.py``: a frozen
    embedding's rows, a frozen head's tiles): never on the device whole. What its rows or tiles
    take on the device is in its unit's transients, their copies in its unit's times; the
    residency tables count it nowhere (``residency.chunk_tables``)."""
    served_fwd_bytes: int = 0
    """Bytes the serving copied in host to device in its unit's forward (the rows indexed, or
    every tile of the head)."""
    served_bwd_bytes: int = 0
    """The same in its unit's backward (the head's tiles again; 0 for an embedding)."""
    served_device_bytes: int = 0
    """Device bytes the serving holds at once beyond the unit's own tensors (two head tiles;
    0 for an embedding, whose rows are its output)."""


@dataclass(frozen=True)
class UnitProfile:
    """Time and memory of one execution unit (a block, or the pre/post part) on the real batch."""

    fwd_s: float
    """Forward time, seconds (also the recompute cost when checkpointed)."""
    bwd_s: float
    """Backward time without recompute, seconds."""
    act_bytes_keep: int
    """Bytes autograd saves for the backward when the unit keeps its activations."""
    act_bytes_checkpoint: int = 0
    """Bytes saved when checkpointed: the unit's inputs only."""
    fwd_transient_bytes: int = 0
    """Peak bytes above ``act_bytes_keep`` inside the forward (temporaries, outputs being built)."""
    bwd_transient_bytes: int = 0
    """Peak bytes above ``act_bytes_keep`` inside the backward (activation grads, temporaries),
    less the unit's parameter gradients and the chunks fetched, which the cost model counts
    itself. Negative (at least ``-act_bytes_keep``) where activations are freed before the
    gradients are made."""
    name: str = ""
    mlp_act_bytes: int = 0
    """Bytes the unit's token-wise MLP saves for the backward beyond its input (its
    intermediates): the part of ``act_bytes_keep`` that tiling the MLP removes. 0 where the unit
    has no MLP that can be tiled (``configuration.with_mlp_tiles``)."""
    mlp_fwd_transient_bytes: int = 0
    """The MLP's forward peak above ``mlp_act_bytes`` (its output being built, temporaries)."""
    mlp_bwd_transient_bytes: int = 0
    """The MLP's backward peak above ``mlp_act_bytes`` (its intermediates' gradients), less its
    parameter gradients, as for ``bwd_transient_bytes``."""
    mlp_fwd_s: float = 0.0
    """The MLP's forward time, seconds: what a tiled MLP's backward adds (it runs the forward
    again, tile by tile)."""
    tiled_act_bytes_keep: int = 0
    """Bytes the unit saves with its MLP and norms tiled (the block probe runs them in
    ``PROBE_TILES`` tiles where the batch is longer than a tile), its input included
    where a tiled norm saves it; 0 where not measured (``configuration.with_mlp_tiles``)."""
    tiled_fwd_peak_bytes: int = 0
    """The forward's peak above the unit's input with its MLP and norms tiled, its saved
    bytes included; 0 where not measured. A tiled block's peak may lie outside its MLP."""
    tiled_bwd_peak_bytes: int = 0
    """The same in the backward, its parameter gradients aside (as for
    ``bwd_transient_bytes``): saved bytes plus the backward's transient, the MLP tiled."""
    tiled_fine_fwd_peak_bytes: int = 0
    """``tiled_fwd_peak_bytes`` with ``PROBE_FINE_TILES`` tiles; 0 where not measured."""
    tiled_fine_bwd_peak_bytes: int = 0
    """``tiled_bwd_peak_bytes`` with ``PROBE_FINE_TILES`` tiles; 0 where not measured."""
    tiled_coarse_fwd_peak_bytes: int = 0
    """``tiled_fwd_peak_bytes`` with ``PROBE_COARSE_TILES`` tiles; 0 where not measured."""
    tiled_coarse_bwd_peak_bytes: int = 0
    """``tiled_bwd_peak_bytes`` with ``PROBE_COARSE_TILES`` tiles; 0 where not measured."""
    growth: tuple[tuple[str, float, float, float], ...] = ()
    """How the fields grow with the batch's length, where the block probe ran on slices of a
    long batch: ``(field, a, b, c)``, the field at ``r`` times this batch's length being
    ``a + b r + c r^2`` (``grown``); empty where the block ran whole."""


# A unit's byte counts (every field named with "bytes"), which scale with the batch
# (``ModelProfile.with_batch_scaled``), and the tiled block's measured peaks among them.
UNIT_BYTE_FIELDS = tuple(f.name for f in fields(UnitProfile) if "bytes" in f.name)
# The tile counts the probe runs a tiled block in, with the prefix of their peaks' fields
# (``tiled_{prefix}fwd_peak_bytes``, ``tiled_{prefix}bwd_peak_bytes``).
TILED_PEAK_PREFIXES = (
    (PROBE_FINE_TILES, "fine_"),
    (PROBE_TILES, ""),
    (PROBE_COARSE_TILES, "coarse_"),
)
TILED_PEAK_FIELDS = tuple(
    f"tiled_{prefix}{side}_peak_bytes"
    for _, prefix in TILED_PEAK_PREFIXES
    for side in ("fwd", "bwd")
)


def grown(growth: tuple[tuple[str, float, float, float], ...], ratio: float) -> dict[str, Any]:
    """The fields ``growth`` describes (``UnitProfile.growth``) at ``ratio`` times the batch's
    length: byte counts as integers, no size or time below 0, a backward's transient no lower
    than minus the saved bytes it frees."""
    out: dict[str, Any] = {}
    for name, a, b, c in growth:
        value = a + b * ratio + c * ratio * ratio
        out[name] = int(round(value)) if name in UNIT_BYTE_FIELDS else max(0.0, value)
    never_negative = (
        "act_bytes_keep",
        "fwd_transient_bytes",
        "mlp_act_bytes",
        "tiled_act_bytes_keep",
        *TILED_PEAK_FIELDS,
    )
    for name in never_negative:
        if name in out:
            out[name] = max(0, out[name])
    if "bwd_transient_bytes" in out and "act_bytes_keep" in out:
        out["bwd_transient_bytes"] = max(-out["act_bytes_keep"], out["bwd_transient_bytes"])
    return out


# ``ModelProfile.accumulate_on``.
ACCUMULATE_CHOICES = ("cpu", "gpu", "auto")


@dataclass(frozen=True)
class ModelProfile:
    """The model as measured on the real first batch, for one chunk layout (one ``chunk_size``)."""

    chunk_size: int
    """Bytes per chunk the layout was built with. Chunks hold at most this much, except a chunk
    holding one parameter larger than it (an unquantized embedding or head), which has that
    parameter's size; ``ChunkProfile.bytes`` is what each chunk really takes."""
    chunks: tuple[ChunkProfile, ...]
    blocks: tuple[UnitProfile, ...]
    pre: UnitProfile
    """Everything before block 0 (embeddings, vision tower, ...); its activations are kept."""
    post: UnitProfile
    """Everything after the last block (final norm, head, logits, loss); kept. The logits and the
    loss's temporaries are its ``act_bytes_keep`` and transients (often the largest transient)."""
    batch_tokens: int = 1
    """Tokens per micro-batch (for tokens/s: ``micro_batches`` of them per step)."""
    static_bytes: int = 0
    """Allocator bytes live all step outside chunks and activations (inputs, buffers, workspace)."""
    other_s: float = 0.0
    """Per-step seconds outside the units (zero_grad, host code, loss scaling)."""
    optim_bytes_per_param: int = 4
    """GPU optimizer state bytes per persistent trainable element (AdamW bf16: 2 states x 2 B)."""
    optim_step_bytes_per_param: int = 0
    """Transient GPU bytes per persistent trainable element while the user's optimizer steps
    (foreach AdamW's whole-group sqrt of ``exp_avg_sq``: one state element; fused kernels: 0)."""
    weight_dtype: str = "bfloat16"
    """Storage dtype of the weights; selects the fragmentation factor."""
    fragmentation: dict[str, float] = field(default_factory=dict)
    """Calibrated allocator fragmentation factor per weight dtype (see
    ``calibration_model.calibrate``)."""
    grad_accumulation: bool = False
    """True when gradients of persistent chunks stay allocated across forwards (accumulation)."""
    micro_batches: int = 1
    """Forward and backward passes per ``optimizer.step()`` (gradient accumulation), as the
    profiled step ran them: the cost model's step is that many micro-batches (``cost_time.py``,
    ``step_windows``), tokens/s counts them all."""
    update_in_backward: bool = False
    """True under ``AUTOOFFLOAD_UPDATE_IN_BACKWARD``: the CPU update of an offloaded chunk starts
    when its gradients arrive in the backward, not at ``optimizer.step()``."""
    persistent_at_step: bool = False
    """Under ``update_in_backward``, True where the persistent chunks are still stepped at
    ``optimizer.step()`` (data parallelism: their gradients are averaged in place across ranks
    first, and held until the step), False where they are stepped in the backward as their
    gradients complete (``runtime/update/persistent_update.py``)."""
    gpu_update: int = 0
    """Offloaded chunks whose update at ``step()`` runs on the GPU, optimizer state streamed from
    pinned memory (``plan/update_split.py``): 0 none, -1 as many as the cost model finds best,
    n > 0 the last n. 0 where the runtime has no GPU path (see ``runtime/update/gpu_update.py``)."""
    gpu_update_in_backward: int = 0
    """Under ``update_in_backward``: the lowest offloaded chunks updated on the GPU at the end
    of their backward (``plan/update_split.backward_split``): 0 none, -1 as many as leave the
    next forward no wait for the CPU, n > 0 the lowest n. 0 where the runtime cannot."""
    accumulate_on: str = "cpu"
    """Where gradient accumulation sums the offloaded chunks' gradients (``micro_batches`` > 1):
    "cpu" (the CPU worker adds each micro-batch's), "gpu" (the running sum comes back to the
    device and is added there before the copy out: ``cost_time.accumulation_terms``), or "auto"
    (the search tries both: ``search._variants``; the cost model reads "auto" as "cpu")."""
    expandable_segments: bool = False
    """True when the allocator uses expandable segments (``EXPANDABLE_FRAGMENTATION`` prior)."""
    checkpoint_inputs_on_cpu: bool = False
    """True for the variant where checkpointed blocks keep their input in host memory
    (``configuration.with_checkpoint_inputs_on_cpu``): its plans name them ``checkpoint_cpu``."""
    host_input_blocks: int = 0
    """In that variant, how many leading blocks keep their inputs on the host (all of them, or
    as many as the host has room for); a checkpointed block after them keeps its input on the
    device."""
    host_input_bytes: tuple[int, ...] = ()
    """In that variant, the bytes of each host-kept block's input (the first
    ``host_input_blocks`` blocks'): what the host holds for a checkpointed one
    (``configuration.host_activation_bytes``)."""
    mlp_tile_tokens: int = 0
    """Tokens per tile of the blocks' MLPs in this variant (``configuration.with_mlp_tiles``);
    0 for the measured, untiled profile."""

    @property
    def persistent_in_backward(self) -> bool:
        """Whether the persistent chunks are stepped in the backward, their gradients dropped
        there (``update_in_backward`` on one process)."""
        return self.update_in_backward and not self.persistent_at_step

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    @property
    def n_chunks(self) -> int:
        return len(self.chunks)

    @property
    def n_units(self) -> int:
        return len(self.blocks) + 2

    @property
    def units(self) -> tuple[UnitProfile, ...]:
        """Pre, the blocks, post: in forward order."""
        return (self.pre, *self.blocks, self.post)

    @property
    def fragmentation_factor(self) -> float:
        """The calibrated factor for ``weight_dtype``, else the prior: ``EXPANDABLE_FRAGMENTATION``
        under expandable segments, else the dtype's ``DEFAULT_FRAGMENTATION``."""
        if self.weight_dtype in self.fragmentation:
            return float(self.fragmentation[self.weight_dtype])
        if self.expandable_segments:
            return EXPANDABLE_FRAGMENTATION
        return DEFAULT_FRAGMENTATION.get(self.weight_dtype, FALLBACK_FRAGMENTATION)

    def with_fragmentation(self, factor: float) -> ModelProfile:
        """A copy whose factor for ``weight_dtype`` is ``factor`` (after
        ``calibration_model.calibrate``)."""
        frag = dict(self.fragmentation)
        frag[self.weight_dtype] = float(factor)
        return replace(self, fragmentation=frag)

    def with_compute_scaled(self, factor: float) -> ModelProfile:
        """A copy whose units' forward and backward times are ``factor`` times the profiled
        ones (``calibration_model.calibrate_compute``: the step runs its blocks slower or faster
        than the probe timed them alone)."""
        return self._with_units(
            lambda unit: replace(
                unit,
                fwd_s=unit.fwd_s * factor,
                bwd_s=unit.bwd_s * factor,
                mlp_fwd_s=unit.mlp_fwd_s * factor,
            )
        )

    def with_outliers_capped(self, outlier_s: float, cap_s: float) -> ModelProfile:
        """A copy whose units' forward and backward times longer than ``outlier_s`` seconds are
        ``cap_s`` (``calibration_model.calibrate_compute_cap``: a stall in a profiled span); a
        capped forward's MLP time shrinks with it."""

        def capped(seconds: float) -> float:
            return cap_s if seconds > outlier_s else seconds

        def unit_capped(unit: UnitProfile) -> UnitProfile:
            fwd_s = capped(unit.fwd_s)
            share = fwd_s / unit.fwd_s if unit.fwd_s > 0 else 1.0
            return replace(
                unit, fwd_s=fwd_s, bwd_s=capped(unit.bwd_s), mlp_fwd_s=unit.mlp_fwd_s * share
            )

        return self._with_units(unit_capped)

    def _with_units(
        self, change: Callable[[UnitProfile], UnitProfile], **fields: Any
    ) -> ModelProfile:
        """A copy with ``change`` applied to every unit (pre, blocks, post) and ``fields`` set."""
        return replace(
            self,
            blocks=tuple(change(b) for b in self.blocks),
            pre=change(self.pre),
            post=change(self.post),
            **fields,
        )

    def with_batch_scaled(self, ratio: float) -> ModelProfile:
        """A copy for a batch ``ratio`` times larger: activation bytes grow linearly (attention
        that is quadratic in the sequence grows more; the OOM retry's budget cut is the margin)."""

        def scaled(unit: UnitProfile) -> UnitProfile:
            return replace(
                unit, **{name: int(getattr(unit, name) * ratio) for name in UNIT_BYTE_FIELDS}
            )

        return self._with_units(scaled, batch_tokens=int(self.batch_tokens * ratio))

    def with_sequence_scaled(self, ratio: float) -> ModelProfile:
        """The profile of a batch of the same rows ``ratio`` times as long, as far as this one
        tells: a block the probe ran on slices takes its fields from their fit
        (``UnitProfile.growth``: attention's time quadratic, the rest as measured); every other
        figure grows linearly with the tokens, times included (attention's time in a block
        probed whole is then under-counted). Chunks and static bytes stay."""
        linear = self.with_batch_scaled(ratio)

        def scaled(unit: UnitProfile, measured: UnitProfile) -> UnitProfile:
            if not measured.growth:
                return replace(
                    unit,
                    fwd_s=measured.fwd_s * ratio,
                    bwd_s=measured.bwd_s * ratio,
                    mlp_fwd_s=measured.mlp_fwd_s * ratio,
                )
            # Relative to the fit at this length, so what changed the unit since it was
            # measured (a calibrated compute factor) carries over: times by their ratio, bytes
            # by their difference.
            at_one, at_ratio = grown(measured.growth, 1.0), grown(measured.growth, ratio)
            changes = {}
            for name, value in at_ratio.items():
                now = getattr(measured, name)
                if name.endswith("_bytes"):
                    changes[name] = now + value - at_one[name]
                else:
                    changes[name] = now * value / at_one[name] if at_one[name] > 0 else value
            return replace(unit, **changes)

        def units(profile: ModelProfile) -> tuple[UnitProfile, ...]:
            return (*profile.blocks, profile.pre, profile.post)

        new = [scaled(u, m) for u, m in zip(units(linear), units(self), strict=True)]
        n = len(self.blocks)

        return replace(
            linear,
            blocks=tuple(new[:n]),
            pre=new[n],
            post=new[n + 1],
            other_s=self.other_s * ratio,
            host_input_bytes=tuple(int(b * ratio) for b in self.host_input_bytes),
        )

    def validate(self) -> None:
        """Raise ``PlanError`` if the profile is inconsistent (unit out of range, negative size)."""
        n_units = self.n_units
        if self.chunk_size <= 0:
            raise PlanError(f"ModelProfile.chunk_size={self.chunk_size} must be > 0 bytes")
        if self.accumulate_on not in ACCUMULATE_CHOICES:
            raise PlanError(
                f"ModelProfile.accumulate_on={self.accumulate_on!r} is not valid; valid:"
                f" {', '.join(ACCUMULATE_CHOICES)}"
            )
        for index, chunk in enumerate(self.chunks):
            if not chunk.units:
                raise PlanError(f"chunk {index} has no units; every chunk is used by some unit")
            if list(chunk.units) != sorted(set(chunk.units)):
                raise PlanError(f"chunk {index} units={chunk.units} must be ascending and unique")
            if chunk.units[0] < 0 or chunk.units[-1] >= n_units:
                raise PlanError(
                    f"chunk {index} units={chunk.units} out of range 0..{n_units - 1}"
                    f" (pre=0, block j=j+1, post={n_units - 1})"
                )
            if min(chunk.bytes, chunk.trainable_bytes, chunk.trainable_numel) < 0:
                raise PlanError(f"chunk {index} has a negative size: {chunk}")
            if chunk.served and chunk.trainable_numel:
                raise PlanError(f"chunk {index} is served from the host but trains: {chunk}")
        for unit in self.units:
            sizes = (
                unit.act_bytes_keep,
                unit.act_bytes_checkpoint,
                unit.fwd_transient_bytes,
                unit.act_bytes_keep + unit.bwd_transient_bytes,
                unit.mlp_act_bytes,
                unit.mlp_fwd_transient_bytes,
                unit.mlp_act_bytes + unit.mlp_bwd_transient_bytes,
                unit.tiled_act_bytes_keep,
                *(getattr(unit, name) for name in TILED_PEAK_FIELDS),
            )
            if min(sizes) < 0 or min(unit.fwd_s, unit.bwd_s, unit.mlp_fwd_s) < 0:
                raise PlanError(f"unit {unit.name or '?'} has a negative time or size: {unit}")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for chunk in data["chunks"]:
            chunk["units"] = list(chunk["units"])
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelProfile:
        """Build from ``to_dict`` output (lists accepted where tuples are stored)."""
        values = dict(data)
        values["chunks"] = tuple(
            ChunkProfile(**{**c, "units": tuple(c["units"])}) for c in data["chunks"]
        )
        values["blocks"] = tuple(_unit_from_dict(b) for b in data["blocks"])
        values["pre"] = _unit_from_dict(data["pre"])
        values["post"] = _unit_from_dict(data["post"])
        values["fragmentation"] = dict(data.get("fragmentation", {}))
        values["host_input_bytes"] = tuple(data.get("host_input_bytes", ()))
        return cls(**values)


def _unit_from_dict(data: dict[str, Any]) -> UnitProfile:
    return UnitProfile(**{**data, "growth": tuple(tuple(g) for g in data.get("growth", ()))})
