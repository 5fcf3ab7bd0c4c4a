"""Exhaustive, vectorised search over the knobs for the fastest plan that fits the memory budget.

For each chunk layout (one ModelProfile per candidate chunk size) the search enumerates every
``n_persist`` (0..n_chunks), every ``n_buffer`` from the smallest valid one up to the one beyond
which the cost model predicts no gain, every ``n_swap`` and every ``n_checkpoint`` with
``n_swap + n_checkpoint <= n_blocks``. It loops in Python over ``n_swap`` only (n_blocks + 1
iterations) and evaluates the rest as numpy arrays: the chunk terms come from
``residency.chunk_tables`` (one row per ``n_persist``), and the step time for every
``n_checkpoint`` is a prefix sum of the per-window recompute cost, because one more checkpoint
only adds the recompute of one more block (``cost.assign_block_policies`` is nested), and the
peak for every ``n_checkpoint`` is read off one running maximum from the front and one from the
back (see ``_split_max``). Chunks on the device per (n_persist, n_buffer, unit) are prefix sums
over the runtime's prefetch order (``residency.queued_bytes``), each chunk at its own size. Work
per layout is O(n_blocks * n_chunks * n_buffers * (n_blocks + n_units)) simple array operations,
with no pruning that could miss the optimum; ``tests/plan/test_search.py`` checks it against a
brute force over ``cost``'s scalar functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from autooffload.errors import PlanError
from autooffload.plan.cost import (
    assign_block_policies,
    backward_update_ready,
    optimizer_step_bytes,
    peak_breakdown,
    predict_step_time,
    with_checkpoint_inputs_on_cpu,
)
from autooffload.plan.profile_types import HardwareProfile, ModelProfile
from autooffload.plan.residency import ChunkTables, chunk_tables, queued_bytes
from autooffload.plan.types import CHECKPOINT_INPUTS, GiB, Knobs, Plan

KNOBS = ("chunk_size", "n_persist", "n_buffer", "n_swap", "n_checkpoint")
_KNOB_ENV = {name: f"AUTOOFFLOAD_{name.upper()}" for name in KNOBS}
_NONE = np.iinfo(np.int64).min // 4  # "no unit": below any peak, far from overflow


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
        )


@dataclass(frozen=True)
class _Pick:
    """One configuration and its predictions; ordered by (step_s, peak) for the choice."""

    step_s: float
    peak: int
    knobs: Knobs
    profile: ModelProfile = field(compare=False, repr=False)


def search(
    profiles_by_chunk_size: dict[int, ModelProfile],
    hw: HardwareProfile,
    budget_bytes: int | None,
    fixed: dict[str, int] | None = None,
    min_persist: int = 0,
    checkpoint_inputs: str = "gpu",
) -> Plan:
    """The fastest configuration whose predicted peak fits ``budget_bytes`` (None: unbounded).

    ``fixed`` pins any subset of ``chunk_size, n_persist, n_buffer, n_swap, n_checkpoint``; the
    search completes the rest, with ``n_persist >= min_persist``. ``checkpoint_inputs``: where
    checkpointed blocks keep their input, ``gpu``, ``cpu`` (``cost.with_checkpoint_inputs_on_cpu``)
    or ``auto`` (both layouts searched). Raises ``PlanError`` when nothing fits, naming the fixed
    knob that makes it infeasible and its nearest feasible value, or the smallest budget that
    would fit.
    """
    fixed = _check_fixed(profiles_by_chunk_size, fixed or {})
    variants = _variants(profiles_by_chunk_size, hw, checkpoint_inputs)
    best, _ = _run(variants, hw, budget_bytes, fixed, min_persist=min_persist)
    if best is None:
        raise _infeasible(variants, hw, budget_bytes, fixed)
    source = "search" if not fixed else ("user" if len(fixed) == len(KNOBS) else "user+search")
    return make_plan(best.profile, hw, best.knobs, budget_bytes, source)


def search_all(
    profiles_by_chunk_size: dict[int, ModelProfile],
    hw: HardwareProfile,
    budget_bytes: int | None,
    fixed: dict[str, int] | None = None,
    min_persist: int = 0,
    checkpoint_inputs: str = "gpu",
) -> Candidates:
    """Every feasible configuration the search evaluates, with its predicted peak and throughput
    (``n_buffer`` values above the last useful one are not evaluated: they only add memory)."""
    fixed = _check_fixed(profiles_by_chunk_size, fixed or {})
    variants = _variants(profiles_by_chunk_size, hw, checkpoint_inputs)
    return _run(variants, hw, budget_bytes, fixed, True, min_persist=min_persist)[1]


def _variants(
    profiles: dict[int, ModelProfile], hw: HardwareProfile, checkpoint_inputs: str
) -> list[ModelProfile]:
    """The layouts to search: each profile as measured and/or with checkpoint inputs on the host."""
    if checkpoint_inputs not in CHECKPOINT_INPUTS:
        raise PlanError(
            f"checkpoint_inputs={checkpoint_inputs!r} is not valid; valid: {CHECKPOINT_INPUTS}"
        )
    ordered = [profiles[size] for size in sorted(profiles)]
    on_cpu = [with_checkpoint_inputs_on_cpu(p, hw) for p in ordered]
    return {"gpu": ordered, "cpu": on_cpu, "auto": ordered + on_cpu}[checkpoint_inputs]


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
    step_s, breakdown, bottleneck = predict_step_time(profile, hw, knobs, tables)
    breakdown.update({f"mem_{key}": value for key, value in memory.items()})
    return Plan(
        chunk_size=profile.chunk_size,
        n_chunks=profile.n_chunks,
        n_persist=knobs.n_persist,
        n_buffer=knobs.n_buffer,
        block_policies=assign_block_policies(
            profile.n_blocks,
            knobs.n_swap,
            knobs.n_checkpoint,
            "checkpoint_cpu" if profile.checkpoint_inputs_on_cpu else "checkpoint",
        ),
        budget_bytes=budget_bytes,
        predicted_peak_bytes=int(memory["peak"]),
        predicted_step_s=step_s,
        bottleneck=bottleneck,
        source=source,
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
) -> tuple[_Pick | None, Candidates]:
    """Search every layout: the best pick (fastest feasible, or smallest peak with ``by_peak``)
    and, with ``collect``, every feasible row."""
    best = None
    rows: list[tuple[np.ndarray, ...]] = []
    for profile in profiles:
        if fixed.get("chunk_size", profile.chunk_size) != profile.chunk_size:
            continue
        pick = _search_layout(
            profile, hw, budget, fixed, rows if collect else None, by_peak, min_persist
        )
        if pick is not None and (best is None or _order(pick, by_peak) < _order(best, by_peak)):
            best = pick
    columns = [np.concatenate(column) for column in zip(*rows)] if rows else [np.zeros(0)] * 8
    return best, Candidates(*columns)


def _order(pick: _Pick, by_peak: bool = False) -> tuple[float, float]:
    return (pick.peak, pick.step_s) if by_peak else (pick.step_s, pick.peak)


def _search_layout(
    profile: ModelProfile,
    hw: HardwareProfile,
    budget: int | None,
    fixed: dict[str, int],
    rows: list[tuple[np.ndarray, ...]] | None,
    by_peak: bool,
    min_persist: int = 0,
) -> _Pick | None:
    """Evaluate every configuration of one layout (see the module docstring for the shape)."""
    tables = chunk_tables(profile)
    n_blocks, n_units = profile.n_blocks, profile.n_units
    if fixed.get("n_persist", 0) > profile.n_chunks:
        return None
    persist = _values(fixed, "n_persist", profile.n_chunks)
    persist = persist[persist >= min_persist]
    static = (
        tables.persist_bytes
        + profile.optim_bytes_per_param * tables.persist_numel
        + profile.static_bytes
        + (tables.persist_grad_total if profile.grad_accumulation else 0)
    )
    frag = profile.fragmentation_factor
    if budget is not None:
        # Prune n_persist whose static bytes and live chunks alone already exceed the budget.
        least = static + tables.resident_bytes.max(axis=1)
        fits = hw.cuda_context_bytes + np.ceil(frag * least[persist].astype(float)) <= budget
        persist = persist[fits]
    buffers, valid = _buffer_grid(tables, persist, fixed.get("n_buffer"))
    if persist.size == 0 or not valid.any():
        return None
    units = profile.units
    fwd_s = np.array([u.fwd_s for u in units])
    bwd_s = np.array([u.bwd_s for u in units])
    keep = np.array([u.act_bytes_keep for u in units], dtype=np.int64)
    ckpt = np.array([u.act_bytes_checkpoint for u in units], dtype=np.int64)
    fwd_transient = np.array([u.fwd_transient_bytes for u in units], dtype=np.int64)
    bwd_transient = np.array([u.bwd_transient_bytes for u in units], dtype=np.int64)
    h2d, d2h, duplex = hw.h2d_bps, hw.d2h_bps, hw.duplex_bps

    # Chunk-traffic terms, shape (P, D, U): the same for every n_swap / n_checkpoint.
    room = np.maximum(buffers[:, :, None] - tables.resident[persist][:, None, :], 0)
    fwd_next_count = _shift(tables.fwd_gather_count[persist], -1)[:, None, :]
    fwd_next_bytes = _shift(tables.fwd_gather_bytes[persist], -1)[:, None, :]
    bwd_prev_count = _shift(tables.bwd_gather_count[persist], 1)[:, None, :]
    bwd_prev_bytes = _shift(tables.bwd_gather_bytes[persist], 1)[:, None, :]
    queued = queued_bytes(
        profile,
        persist,
        [room, np.minimum(room, fwd_next_count)],
        [room, np.minimum(room, bwd_prev_count)],
    )
    (fwd_window, fwd_prefetch), (bwd_window, bwd_prefetch) = queued
    fwd_exposed = (fwd_next_bytes - fwd_prefetch).astype(float) / h2d
    bwd_exposed = (bwd_prev_bytes - bwd_prefetch).astype(float) / h2d
    fwd_prefetch, bwd_prefetch = fwd_prefetch.astype(float), bwd_prefetch.astype(float)
    grads_out = _shift(tables.grad_d2h_bytes[persist], -1).astype(float)[:, None, :]
    gpu_optim = tables.persist_numel[persist] / hw.gpu_optim_params_per_s
    first_gather = tables.fwd_gather_bytes[persist, 0] / h2d
    ready_numel = tables.cpu_ready_numel[persist]
    if profile.update_in_backward:
        done = backward_update_ready(profile, tables, hw.cpu_optim_params_per_s)[persist]
        cpu_done = np.broadcast_to(done[:, None], ready_numel.shape)
    else:
        cpu_done = ready_numel / hw.cpu_optim_params_per_s
    ready = np.where(ready_numel >= 0, cpu_done + tables.fwd_gather_bytes[persist] / h2d, -np.inf)[
        :, None, :
    ]
    tail = tables.grad_d2h_bytes[persist, 0] / d2h
    start = np.maximum(gpu_optim, first_gather)

    # Memory terms per (P, D, U): chunks on the device (live + prefetched) and, in the backward,
    # the live grads; the static bytes per P.
    live = tables.resident_bytes[persist][:, None, :]
    grads = tables.offload_grad_bytes[persist]
    if not profile.grad_accumulation:
        grads = grads + tables.persist_grad_bytes[persist]
    # Two allocator pools (``cost.peak_breakdown``): the chunk buffers' peak over the step, and
    # the compute stream's (activations, plus the gradients in the backward).
    chunk_pool = np.maximum((live + fwd_window).max(-1), (live + bwd_window).max(-1))
    fwd_extra = np.zeros((1, 1, n_units), dtype=np.int64)
    bwd_extra = grads[:, None, :]
    static_p = static[persist][None, :, None]
    step_bytes = optimizer_step_bytes(profile, tables, persist)[None, :, None]

    best = None
    unit_index = np.arange(n_units)
    for n_swap in _values(fixed, "n_swap", n_blocks):
        checkpoints = _values(fixed, "n_checkpoint", n_blocks - n_swap)
        if checkpoints.size == 0:
            continue
        swapped = (unit_index >= 1) & (unit_index <= n_swap)
        swap_out = np.where(swapped, keep, 0).astype(float)
        swap_in = _shift(swap_out, 1)

        # Step time, shape (K, P, D): forward windows, CPU-optimizer max-plus, backward + prefix.
        fwd_xfer = _transfer(fwd_prefetch, swap_out, h2d, d2h, duplex)
        fwd_windows = np.maximum(fwd_s, fwd_xfer) + fwd_exposed
        after = np.cumsum(fwd_windows[..., ::-1], axis=-1)[..., ::-1]
        t_fwd = np.maximum(start[:, None] + after[..., 0], (ready + after).max(axis=-1))
        bwd_xfer = _transfer(bwd_prefetch + swap_in, grads_out, h2d, d2h, duplex)
        base = np.maximum(bwd_s, bwd_xfer)
        extra = np.maximum(bwd_s + fwd_s, bwd_xfer) - base
        t_bwd = tail[:, None] + (base + bwd_exposed).sum(axis=-1)
        extra_before = np.concatenate([np.zeros((*extra.shape[:2], 1)), extra.cumsum(-1)], -1)
        recompute = extra_before[..., n_swap + 1 + checkpoints] - extra_before[..., [n_swap + 1]]
        step = (t_fwd + t_bwd)[None] + np.moveaxis(recompute, -1, 0) + profile.other_s

        # Peak memory, shape (K, P, D), for every n_checkpoint at once without a K x P x D x U
        # array: with k checkpoints, units u <= n_swap + k + 1 see every non-swapped block before
        # them checkpointed, and later units see the keep-all events minus the constant saving
        # C_k of the k checkpoints (``cost.activation_events``): a prefix max and a suffix max.
        kept = np.where(swapped, 0, keep)
        blocks = (unit_index > n_swap) & (unit_index <= n_blocks)
        all_ckpt = np.where(blocks, ckpt, kept)
        current = _shift(np.where(swapped, keep, 0), 1) + keep
        events_ckpt = np.cumsum(all_ckpt) - all_ckpt + current
        events_keep = np.cumsum(kept) - kept + current
        bound = n_swap + 1 + checkpoints
        saving = np.cumsum(keep - ckpt)
        saving = saving[bound - 1] - saving[n_swap]
        fwd_peak = _split_max(
            events_ckpt + fwd_transient, events_keep + fwd_transient, fwd_extra, bound, saving
        )
        bwd_peak = _split_max(
            events_ckpt + bwd_transient, events_keep + bwd_transient, bwd_extra, bound, saving
        )
        compute = np.maximum(np.maximum(fwd_peak, bwd_peak), step_bytes)
        pooled = static_p + compute + chunk_pool[None]
        peak = hw.cuda_context_bytes + np.ceil(frag * pooled.astype(float)).astype(np.int64)

        ok = np.broadcast_to(valid[None], peak.shape)
        if budget is not None:
            ok = ok & (peak <= budget)
        best = _better_pick(
            best, peak, step, ok, profile, persist, buffers, n_swap, checkpoints, by_peak
        )
        if rows is not None and ok.any():
            k_idx, p_idx, d_idx = np.nonzero(ok)
            count = k_idx.size
            rows.append(
                (
                    np.full(count, profile.chunk_size, dtype=np.int64),
                    persist[p_idx],
                    buffers[p_idx, d_idx],
                    np.full(count, n_swap, dtype=np.int64),
                    checkpoints[k_idx],
                    peak[ok],
                    step[ok],
                    profile.batch_tokens / step[ok],
                )
            )
    return best


def _split_max(
    events_before: np.ndarray,
    events_after: np.ndarray,
    extra: np.ndarray,
    bound: np.ndarray,
    saving: np.ndarray,
) -> np.ndarray:
    """max(max_{u <= b_k} (events_before[u] + extra[p,d,u]),
           max_{u > b_k} (events_after[u] + extra[p,d,u]) - saving[k]), shape (K, P, D).

    ``extra``: per-unit bytes on top of the events (the backward's gradients; broadcastable to
    (P, D, U)). Running maxima are taken from the smallest ``b_k`` on only (the rest is one max)."""
    low = int(bound.min())
    head = (events_before[:low] + extra[..., :low]).max(axis=-1, initial=_NONE)
    before = np.maximum.accumulate(events_before[low:] + extra[..., low:], axis=-1)
    after = np.maximum.accumulate((events_after[low:] + extra[..., low:])[..., ::-1], axis=-1)
    after = np.concatenate([after[..., ::-1], np.full((*after.shape[:-1], 1), _NONE)], axis=-1)
    at = bound - low
    best = np.maximum(np.maximum(head[..., None], before[..., at]), after[..., at + 1] - saving)
    return np.moveaxis(best, -1, 0)


def _values(fixed: dict[str, int], name: str, high: int) -> np.ndarray:
    """The values a knob takes: the fixed one, or 0..high."""
    if name in fixed:
        return np.array([fixed[name]] if fixed[name] <= high else [], dtype=np.int64)
    return np.arange(high + 1, dtype=np.int64)


def _buffer_grid(
    tables: ChunkTables, persist: np.ndarray, fixed_buffers: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """n_buffer per (n_persist, offset) and whether it is evaluated: min_buffers[p] + offset, up to
    useful_buffers[p]; a fixed n_buffer is one column, valid where it is >= min_buffers[p]."""
    low = tables.min_buffers[persist]
    if fixed_buffers is not None:
        buffers = np.full((persist.size, 1), fixed_buffers, dtype=np.int64)
        return buffers, buffers[:, 0:1] >= low[:, None]
    high = tables.useful_buffers[persist]
    offsets = np.arange(int((high - low).max()) + 1 if persist.size else 1)
    buffers = low[:, None] + offsets[None, :]
    return buffers, buffers <= high[:, None]


def _shift(values: np.ndarray, by: int) -> np.ndarray:
    """Along the last axis: by=-1 puts unit u+1's value at u, by=1 unit u-1's; zeros fill in."""
    out = np.zeros_like(values)
    if by < 0:
        out[..., :by] = values[..., -by:]
    else:
        out[..., by:] = values[..., :-by]
    return out


def _transfer(h2d_bytes, d2h_bytes, h2d: float, d2h: float, duplex: float) -> np.ndarray:
    """Vectorised ``cost.transfer_s``."""
    both = np.maximum(h2d_bytes / h2d, d2h_bytes / d2h)
    return np.maximum(both, (h2d_bytes + d2h_bytes) / duplex)


def _better_pick(
    current: _Pick | None,
    peak: np.ndarray,
    step: np.ndarray,
    ok: np.ndarray,
    profile: ModelProfile,
    persist: np.ndarray,
    buffers: np.ndarray,
    n_swap: int,
    checkpoints: np.ndarray,
    by_peak: bool = False,
) -> _Pick | None:
    """The better of ``current`` and the best allowed entry of (peak, step) [K, P, D]."""
    if not ok.any():
        return current
    primary, secondary = (peak, step) if by_peak else (step, peak)
    primary = np.where(ok, primary, np.inf)
    candidates = np.flatnonzero(primary == primary.min())
    index = candidates[np.argmin(secondary.ravel()[candidates])]
    k_idx, p_idx, d_idx = np.unravel_index(index, peak.shape)
    knobs = Knobs(int(persist[p_idx]), int(buffers[p_idx, d_idx]), n_swap, int(checkpoints[k_idx]))
    pick = _Pick(
        float(step[k_idx, p_idx, d_idx]),
        int(peak[k_idx, p_idx, d_idx]),
        knobs,
        profile,
    )
    if current is None:
        return pick
    return pick if _order(pick, by_peak) < _order(current, by_peak) else current


def _infeasible(
    profiles: list[ModelProfile],
    hw: HardwareProfile,
    budget: int | None,
    fixed: dict[str, int],
) -> PlanError:
    """The error for an empty feasible set: which fixed knob to change and to what, or budget."""
    budget_text = (
        "unbounded budget" if budget is None else f"budget {budget / GiB:.2f} GiB ({budget} bytes)"
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
    best_peak = f"{smallest.peak / GiB:.2f} GiB"
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
        f" set AUTOOFFLOAD_BUDGET >= {smallest.peak} bytes or use a smaller batch"
    )


__all__ = [
    "CHECKPOINT_INPUTS",
    "KNOBS",
    "Candidates",
    "SearchRequest",
    "make_plan",
    "search",
    "search_all",
]
