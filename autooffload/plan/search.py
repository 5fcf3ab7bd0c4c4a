"""Exhaustive, vectorised search over the knobs for the fastest plan that fits the memory budget.

For each chunk layout (one ModelProfile per candidate chunk size) the search enumerates every
``n_persist`` (0..n_chunks), every ``n_buffer`` from the smallest valid one up to the one beyond
which the cost model predicts no gain, every ``n_swap`` and every ``n_checkpoint`` with
``n_swap + n_checkpoint <= n_blocks``. It loops in Python over ``n_swap`` only (n_blocks + 1
iterations) and evaluates the rest as numpy arrays: the chunk terms come from
``residency.chunk_tables`` (one row per ``n_persist``), and the step time for every ``n_checkpoint``
is a prefix sum of the per-window recompute cost, because one more checkpoint only adds the
recompute of one more block (``configuration.assign_block_policies`` is nested), and the peak for
every ``n_checkpoint`` is read off one running maximum from the front and one from the back (see
``_split_max``). Chunks on the device per (n_persist, n_buffer, unit) are prefix sums
over the runtime's prefetch order (``residency.queued_bytes``), each chunk at its own size. Work
per layout is O(n_blocks * n_chunks * n_buffers * (n_blocks + n_units)) simple array operations,
with no pruning that could miss the optimum; ``tests/plan/test_search.py`` checks it against a
brute force over the cost model's scalar functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from autooffload.errors import PlanError
from autooffload.plan.configuration import (
    assign_block_policies,
    has_tileable_mlp,
    host_activation_bytes,
    host_input_policies,
    serves_chunks,
    with_checkpoint_inputs_on_cpu,
    with_mlp_tiles,
    with_served_chunks_gathered,
)
from autooffload.plan.cost_memory import peak_breakdown
from autooffload.plan.cost_time import predict_step, predict_step_time
from autooffload.plan.grid import Pick, pick_order, search_layout
from autooffload.plan.profile_types import HardwareProfile, ModelProfile
from autooffload.plan.residency import chunk_tables
from autooffload.plan.types import CHECKPOINT_INPUTS, Knobs, Plan, format_bytes
from autooffload.plan.update_split import GPU_UPDATE_AUTO, GPU_UPDATE_OFF

KNOBS = ("chunk_size", "n_persist", "n_buffer", "n_swap", "n_checkpoint")
# ``_best_backward_split``: counts tried one by one up to this many, else coarse to fine.
EXHAUSTIVE_COUNTS = 16
COARSE_POINTS = 7
_KNOB_ENV = {name: f"AUTOOFFLOAD_{name.upper()}" for name in KNOBS}
# Tokens per tile the search tries for the blocks' MLPs (those below the batch's tokens): large
# enough that a tile's matmuls stay efficient, small enough to cut a long sequence's MLP bytes.
MLP_TILE_TOKENS = (8192, 16384, 32768)


@dataclass(frozen=True)
class Candidates:
    """Every evaluated configuration that fits the budget (parallel arrays, one row each)."""

    chunk_size: np.ndarray
    n_persist: np.ndarray
    n_buffer: np.ndarray
    n_swap: np.ndarray
    n_checkpoint: np.ndarray
    peak_bytes: np.ndarray
    step_s: np.ndarray
    tokens_per_s: np.ndarray

    def __len__(self) -> int:
        return len(self.step_s)

    def frontier(self) -> np.ndarray:
        """Row indices of the Pareto frontier (no other row is both smaller and faster), by peak."""
        order = np.lexsort((self.step_s, self.peak_bytes))
        best = np.inf
        keep = []
        for row in order:
            if self.step_s[row] < best:
                best = self.step_s[row]
                keep.append(row)
        return np.array(keep, dtype=np.int64)


@dataclass(frozen=True)
class SearchRequest:
    """The inputs of one search: profiled layouts, hardware, budget and fixed knobs.

    The runtime keeps the request behind its plan, so the feasible set that plan was chosen from
    can be listed later (``candidates()``) without profiling again.
    """

    profiles_by_chunk_size: dict[int, ModelProfile]
    hw: HardwareProfile
    budget_bytes: int | None
    fixed: dict[str, int] = field(default_factory=dict)
    min_persist: int = 0
    """Lower bound of ``n_persist`` (a re-plan may promote chunks, never demote them)."""
    checkpoint_inputs: str = "gpu"
    """Where checkpointed blocks keep their input: ``gpu``, ``cpu`` or ``auto`` (both searched)."""
    mlp_tiles: tuple[int, ...] | None = None
    """Tokens per MLP tile to try (``search``); None: ``MLP_TILE_TOKENS``."""
    host_input_blocks: int | None = None
    """The most leading blocks whose inputs the host has room for (None: all of them)."""
    host_room: int | None = None
    """Host bytes the activations may take, swapped blocks' and host-kept inputs together
    (``configuration.host_activation_bytes``; None: unbounded)."""

    def plan(self) -> Plan:
        """The fastest feasible configuration (``search``)."""
        return search(*self._arguments())

    def candidates(self) -> Candidates:
        """Every feasible configuration evaluated (``search_all``)."""
        return search_all(*self._arguments())

    def _arguments(self) -> tuple:
        return (
            self.profiles_by_chunk_size,
            self.hw,
            self.budget_bytes,
            self.fixed,
            self.min_persist,
            self.checkpoint_inputs,
            self.mlp_tiles,
            self.host_input_blocks,
            self.host_room,
        )


def search(
    profiles_by_chunk_size: dict[int, ModelProfile],
    hw: HardwareProfile,
    budget_bytes: int | None,
    fixed: dict[str, int] | None = None,
    min_persist: int = 0,
    checkpoint_inputs: str = "gpu",
    mlp_tiles: tuple[int, ...] | None = None,
    host_input_blocks: int | None = None,
    host_room: int | None = None,
) -> Plan:
    """The fastest configuration whose predicted peak fits ``budget_bytes`` (None: unbounded).

    ``fixed`` pins any subset of ``chunk_size, n_persist, n_buffer, n_swap, n_checkpoint``; the
    search completes the rest, with ``n_persist >= min_persist``. ``checkpoint_inputs``: where
    checkpointed blocks keep their input, ``gpu``, ``cpu``
    (``configuration.with_checkpoint_inputs_on_cpu``) or ``auto`` (both layouts searched). Raises
    ``PlanError`` when nothing fits, naming the fixed knob that makes it infeasible and its nearest
    feasible value, or the smallest budget that would fit.

    The blocks' MLPs are tiled (``configuration.with_mlp_tiles``, tiles of ``mlp_tiles`` tokens
    below the batch's) only where the budget binds: where the fastest untiled plan that fits is
    slower than the fastest untiled plan unbounded, or none fits. Tiling only adds time to a
    plan with the same knobs (the backward's second MLP forward); it wins where its smaller
    activations let faster knobs fit, and the fastest plan over every tile size is taken.

    ``host_room`` bounds the host bytes of the activations (swapped blocks' saved tensors and
    host-kept checkpoint inputs, ``configuration.host_activation_bytes``): a configuration
    over it is not feasible, and where only such configurations fit, the error says so.
    """
    fixed = _check_fixed(profiles_by_chunk_size, fixed or {})
    host = host_input_blocks
    variants = _variants(profiles_by_chunk_size, hw, checkpoint_inputs, 0, host)
    best, _ = _run(variants, hw, budget_bytes, fixed, min_persist=min_persist, host_room=host_room)
    tiles = _mlp_tile_choices(profiles_by_chunk_size, mlp_tiles)
    if tiles and budget_bytes is not None:
        unbounded, _ = _run(variants, hw, None, fixed, min_persist=min_persist, host_room=host_room)
        if best is None or (unbounded is not None and best.step_s > unbounded.step_s * (1 + 1e-9)):
            for tile in tiles:
                tiled = _variants(profiles_by_chunk_size, hw, checkpoint_inputs, tile, host)
                pick, _ = _run(
                    tiled, hw, budget_bytes, fixed, min_persist=min_persist, host_room=host_room
                )
                if pick is not None and (best is None or pick_order(pick) < pick_order(best)):
                    best = pick
    if best is None and host_room is not None:
        try:
            unlimited = search(
                profiles_by_chunk_size,
                hw,
                budget_bytes,
                fixed,
                min_persist,
                checkpoint_inputs,
                mlp_tiles,
                host_input_blocks,
            )
        except PlanError:
            pass  # nothing fits the device either: that error, below
        else:
            held = unlimited.host_activation_bytes
            raise PlanError(
                f"every configuration that fits the device keeps more activations in host memory"
                f" than the {format_bytes(host_room)} available for them (the fastest:"
                f" {format_bytes(held)}, {unlimited.n_swap} blocks swapped); free host memory,"
                " raise the budget, shorten the batch, or fix AUTOOFFLOAD_N_SWAP lower"
            )
    if best is None:
        every = variants + [
            v
            for tile in tiles
            for v in _variants(profiles_by_chunk_size, hw, checkpoint_inputs, tile, host)
        ]
        raise _infeasible(every, hw, budget_bytes, fixed, min_persist)
    source = "search" if not fixed else ("user" if len(fixed) == len(KNOBS) else "user+search")
    profile = _best_backward_split(best.profile, hw, best.knobs, budget_bytes)
    return make_plan(profile, hw, best.knobs, budget_bytes, source)


def _best_backward_split(
    profile: ModelProfile, hw: HardwareProfile, knobs: Knobs, budget: int | None
) -> ModelProfile:
    """With the GPU's updates in the backward on auto (``update_split.backward_gpu_chunks``,
    a per-n_persist estimate the search runs with), the count of them that the cost model
    predicts fastest for the chosen knobs, among those whose peak fits: the estimate sees
    neither the link the state shares with the chunk gathers nor the knobs. Every count up to
    ``EXHAUSTIVE_COUNTS``; beyond, a coarse-to-fine search (the step falls while the CPU's
    wait shrinks and rises with the link's load: 300 chunks took 12 s exhaustively)."""
    if not profile.update_in_backward or profile.gpu_update_in_backward != GPU_UPDATE_AUTO:
        return profile
    tables = chunk_tables(profile)
    trainable = sum(1 for c in profile.chunks[knobs.n_persist :] if c.trainable_numel > 0)
    seen: dict[int, tuple[float, ModelProfile]] = {}

    def step_of(k: int) -> float:
        if k not in seen:
            fixed = replace(profile, gpu_update_in_backward=k if k else GPU_UPDATE_OFF)
            fits = budget is None or peak_breakdown(fixed, hw, knobs, tables)["peak"] <= budget
            step_s = predict_step_time(fixed, hw, knobs, tables)[0] if fits else float("inf")
            seen[k] = (step_s, fixed)
        return seen[k][0]

    low, high = 0, trainable
    while high - low + 1 > EXHAUSTIVE_COUNTS:
        points = sorted({int(round(x)) for x in np.linspace(low, high, COARSE_POINTS)})
        best = min(points, key=lambda k: (step_of(k), k))
        at = points.index(best)
        low, high = points[max(at - 1, 0)], points[min(at + 1, len(points) - 1)]
    for k in range(low, high + 1):
        step_of(k)
    estimate = predict_step_time(profile, hw, knobs, tables)[0]
    best_k = min(seen, key=lambda k: (seen[k][0], k))
    return seen[best_k][1] if seen[best_k][0] < estimate - 1e-12 else profile


def search_all(
    profiles_by_chunk_size: dict[int, ModelProfile],
    hw: HardwareProfile,
    budget_bytes: int | None,
    fixed: dict[str, int] | None = None,
    min_persist: int = 0,
    checkpoint_inputs: str = "gpu",
    mlp_tiles: tuple[int, ...] | None = None,
    host_input_blocks: int | None = None,
    host_room: int | None = None,
) -> Candidates:
    """Every feasible configuration the search evaluates, with its predicted peak and throughput
    (``n_buffer`` values above the last useful one are not evaluated: they only add memory),
    the tiled MLPs' variants included."""
    fixed = _check_fixed(profiles_by_chunk_size, fixed or {})
    host = host_input_blocks
    variants = _variants(profiles_by_chunk_size, hw, checkpoint_inputs, 0, host)
    for tile in _mlp_tile_choices(profiles_by_chunk_size, mlp_tiles):
        variants += _variants(profiles_by_chunk_size, hw, checkpoint_inputs, tile, host)
    return _run(
        variants, hw, budget_bytes, fixed, True, min_persist=min_persist, host_room=host_room
    )[1]


def _mlp_tile_choices(
    profiles: dict[int, ModelProfile], mlp_tiles: tuple[int, ...] | None
) -> tuple[int, ...]:
    """The MLP tile sizes to search: those below the batch's tokens, where a block's MLP can be
    tiled (none otherwise)."""
    tiles = MLP_TILE_TOKENS if mlp_tiles is None else mlp_tiles
    profile = next(iter(profiles.values()))
    if not has_tileable_mlp(profile):
        return ()
    return tuple(sorted({int(t) for t in tiles if 0 < t < profile.batch_tokens}))


def _variants(
    profiles: dict[int, ModelProfile],
    hw: HardwareProfile,
    checkpoint_inputs: str,
    mlp_tile_tokens: int = 0,
    host_input_blocks: int | None = None,
) -> list[ModelProfile]:
    """The layouts to search: each profile as measured and/or with checkpoint inputs on the host
    (every block's, or the first ``host_input_blocks`` blocks'), its MLPs in tiles of
    ``mlp_tile_tokens`` tokens (0: untiled); a profile that serves chunks from the host also with
    them gathered whole (``configuration.with_served_chunks_gathered``)."""
    if checkpoint_inputs not in CHECKPOINT_INPUTS:
        raise PlanError(
            f"checkpoint_inputs={checkpoint_inputs!r} is not valid; valid: {CHECKPOINT_INPUTS}"
        )
    ordered = [profiles[size] for size in sorted(profiles)]
    ordered += [with_served_chunks_gathered(p, hw) for p in ordered if serves_chunks(p)]
    if mlp_tile_tokens:
        ordered = [with_mlp_tiles(p, mlp_tile_tokens) for p in ordered]
    on_cpu = [with_checkpoint_inputs_on_cpu(p, hw, host_input_blocks) for p in ordered]
    if host_input_blocks == 0:
        on_cpu = []  # the host has room for no block's input
    variants = {"gpu": ordered, "cpu": on_cpu, "auto": ordered + on_cpu}[checkpoint_inputs]
    # Gradient accumulation on auto: the sums added on the CPU or on the GPU, the faster.
    return [replace(p, accumulate_on=where) for p in variants for where in _accumulate_choices(p)]


def _accumulate_choices(profile: ModelProfile) -> tuple[str, ...]:
    """``ModelProfile.accumulate_on`` values to search: both on auto with accumulation."""
    if profile.accumulate_on != "auto":
        return (profile.accumulate_on,)
    return ("cpu", "gpu") if profile.micro_batches > 1 else ("cpu",)


def make_plan(
    profile: ModelProfile,
    hw: HardwareProfile,
    knobs: Knobs,
    budget_bytes: int | None,
    source: str = "user",
) -> Plan:
    """A Plan for explicit knobs, with the cost model's predictions filled in."""
    tables = chunk_tables(profile)
    memory = peak_breakdown(profile, hw, knobs, tables)
    prediction = predict_step(profile, hw, knobs, tables)
    breakdown = {**prediction.breakdown, **{f"mem_{key}": value for key, value in memory.items()}}
    return Plan(
        chunk_size=profile.chunk_size,
        n_chunks=profile.n_chunks,
        n_persist=knobs.n_persist,
        n_buffer=knobs.n_buffer,
        block_policies=host_input_policies(
            assign_block_policies(
                profile.n_blocks,
                knobs.n_swap,
                knobs.n_checkpoint,
                "checkpoint_cpu" if profile.checkpoint_inputs_on_cpu else "checkpoint",
            ),
            profile.host_input_blocks,
        ),
        host_input_blocks=profile.host_input_blocks if profile.checkpoint_inputs_on_cpu else 0,
        host_activation_bytes=host_activation_bytes(profile, knobs.n_swap, knobs.n_checkpoint),
        budget_bytes=budget_bytes,
        predicted_peak_bytes=int(memory["peak"]),
        predicted_step_s=prediction.step_s,
        bottleneck=prediction.bottleneck,
        source=source,
        update=prediction.update,
        mlp_tile_tokens=profile.mlp_tile_tokens,
        host_served_chunks=tuple(i for i, c in enumerate(profile.chunks) if c.served),
        breakdown=breakdown,
    )


def _check_fixed(profiles: dict[int, ModelProfile], fixed: dict[str, int]) -> dict[str, int]:
    """Validate the names and ranges of fixed knobs (ranges that do not depend on the others)."""
    if not profiles:
        raise PlanError("profiles_by_chunk_size is empty; profile at least one chunk layout")
    unknown = sorted(set(fixed) - set(KNOBS))
    if unknown:
        raise PlanError(f"unknown fixed knob(s) {unknown}; valid knobs: {', '.join(KNOBS)}")
    fixed = {name: int(value) for name, value in fixed.items() if value is not None}
    if "chunk_size" in fixed and fixed["chunk_size"] not in profiles:
        raise PlanError(
            f"chunk_size={fixed['chunk_size']} was not profiled; valid: {sorted(profiles)}"
        )
    chosen = [profiles[fixed["chunk_size"]]] if "chunk_size" in fixed else list(profiles.values())
    n_blocks = chosen[0].n_blocks
    max_chunks = max(p.n_chunks for p in chosen)
    limits = {"n_persist": max_chunks, "n_swap": n_blocks, "n_checkpoint": n_blocks}
    for name, high in limits.items():
        if name in fixed and not 0 <= fixed[name] <= high:
            raise PlanError(f"{name}={fixed[name]} is out of range; valid: 0..{high}")
    if fixed.get("n_buffer", 1) < 1:
        raise PlanError(f"n_buffer={fixed['n_buffer']} is out of range; valid: >= 1")
    if fixed.get("n_swap", 0) + fixed.get("n_checkpoint", 0) > n_blocks:
        raise PlanError(
            f"n_swap={fixed['n_swap']} + n_checkpoint={fixed['n_checkpoint']} exceeds"
            f" n_blocks={n_blocks}; valid: a sum <= {n_blocks}"
        )
    return fixed


def _run(
    profiles: list[ModelProfile],
    hw: HardwareProfile,
    budget: int | None,
    fixed: dict[str, int],
    collect: bool = False,
    by_peak: bool = False,
    min_persist: int = 0,
    host_room: int | None = None,
) -> tuple[Pick | None, Candidates]:
    """Search every layout: the best pick (fastest feasible, or smallest peak with ``by_peak``)
    and, with ``collect``, every feasible row (``host_room``: as for ``search``)."""
    best = None
    rows: list[tuple[np.ndarray, ...]] = []
    for profile in profiles:
        if fixed.get("chunk_size", profile.chunk_size) != profile.chunk_size:
            continue
        pick = search_layout(
            profile, hw, budget, fixed, rows if collect else None, by_peak, min_persist, host_room
        )
        if pick is not None and (
            best is None or pick_order(pick, by_peak) < pick_order(best, by_peak)
        ):
            best = pick
    columns = [np.concatenate(column) for column in zip(*rows)] if rows else [np.zeros(0)] * 8
    return best, Candidates(*columns)


def _infeasible(
    profiles: list[ModelProfile],
    hw: HardwareProfile,
    budget: int | None,
    fixed: dict[str, int],
    min_persist: int = 0,
) -> PlanError:
    """The error for an empty feasible set: which fixed knob to change and to what, or budget."""
    budget_text = "unbounded budget" if budget is None else f"budget of {format_bytes(budget)}"
    if min_persist and _run(profiles, hw, budget, fixed)[0] is not None:
        # Only the floor on n_persist (chunks already persistent) is in the way.
        floor = _run(profiles, hw, None, fixed, by_peak=True, min_persist=min_persist)[0]
        least = "" if floor is None else f" (smallest predicted peak {format_bytes(floor.peak)})"
        return PlanError(
            f"no configuration keeping the {min_persist} persistent chunks (n_persist >="
            f" {min_persist}) fits the {budget_text}{least}; plans with fewer fit"
        )
    alternatives = []
    for name in KNOBS:
        if name not in fixed:
            continue
        freed = {key: value for key, value in fixed.items() if key != name}
        found = _run(profiles, hw, budget, freed, collect=True)[1]
        if len(found):
            values = np.unique(getattr(found, name))
            nearest = int(values[np.argmin(np.abs(values - fixed[name]))])
            alternatives.append(f"{name}={nearest} (set {_KNOB_ENV[name]}={nearest} or unset it)")
    asked = ", ".join(f"{name}={value}" for name, value in fixed.items())
    smallest = _run(profiles, hw, None, fixed, by_peak=True)[0]
    if smallest is None:
        return PlanError(
            f"{asked} leaves no valid configuration (n_buffer must cover one unit's chunks);"
            f" unset {', '.join(_KNOB_ENV[name] for name in fixed)} and let the search choose"
        )
    best_peak = format_bytes(smallest.peak)
    if alternatives:
        return PlanError(
            f"{asked} cannot fit the {budget_text}: the smallest predicted peak with it is"
            f" {best_peak}; nearest feasible: {' or '.join(alternatives)}"
        )
    if fixed:
        return PlanError(
            f"{asked} cannot fit the {budget_text} (smallest predicted peak {best_peak}), and no"
            " single fixed knob can be changed to fit; unset them or raise AUTOOFFLOAD_BUDGET"
        )
    knobs = smallest.knobs
    return PlanError(
        f"no configuration fits the {budget_text}: the smallest predicted peak is {best_peak}"
        f" (chunk_size={smallest.profile.chunk_size}, n_persist={knobs.n_persist},"
        f" n_buffer={knobs.n_buffer}, n_swap={knobs.n_swap}, n_checkpoint={knobs.n_checkpoint});"
        f" set AUTOOFFLOAD_BUDGET >= {math.ceil(smallest.peak / (1 << 20))}MiB or use a smaller"
        " batch"
    )


__all__ = [
    "CHECKPOINT_INPUTS",
    "KNOBS",
    "MLP_TILE_TOKENS",
    "Candidates",
    "SearchRequest",
    "make_plan",
    "search",
    "search_all",
]
