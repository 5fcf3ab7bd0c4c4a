"""The search: the optimum of a brute force over the scalar cost model, overrides, errors, speed."""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import time
from dataclasses import replace

import numpy as np
import pytest
from plan_profiles import MiB, layout_chunks, make_hardware, make_profile

from autooffload.errors import PlanError
from autooffload.plan.configuration import with_checkpoint_inputs_on_cpu
from autooffload.plan.cost_memory import peak_breakdown, predict_peak_bytes
from autooffload.plan.cost_time import predict_step_time
from autooffload.plan.profile_types import ModelProfile
from autooffload.plan.residency import chunk_tables
from autooffload.plan.search import EXHAUSTIVE_COUNTS, SearchRequest, make_plan, search, search_all
from autooffload.plan.types import Knobs, format_bytes

SMALL = dict(n_blocks=4, chunk_size=48 * MiB, block_param_bytes=64 * MiB)


_SCORED: dict[str, list] = {}


def brute_force(profiles, hw, budget, fixed=None):
    """Every valid configuration, scored by the cost model's scalar functions:
    [(step, peak, cs, knobs)].

    ``n_buffer`` goes two past the search's last useful value, so the claim that more buffers
    never help beyond it is checked too."""
    key = repr((profiles, hw))
    if key not in _SCORED:
        _SCORED[key] = list(_score_all(profiles, hw))
    wanted = {k: v for k, v in (fixed or {}).items() if k != "chunk_size"}
    return [
        row
        for row in _SCORED[key]
        if (budget is None or row[1] <= budget)
        and (fixed or {}).get("chunk_size", row[2]) == row[2]
        and all(getattr(row[3], name) == value for name, value in wanted.items())
    ]


def _score_all(profiles, hw):
    for chunk_size, profile in profiles.items():
        tables = chunk_tables(profile)
        n_blocks = profile.n_blocks
        for p, s, k in itertools.product(
            range(profile.n_chunks + 1), range(n_blocks + 1), range(n_blocks + 1)
        ):
            if s + k > n_blocks:
                continue
            for b in range(int(tables.min_buffers[p]), int(tables.useful_buffers[p]) + 3):
                knobs = Knobs(p, b, s, k)
                peak = predict_peak_bytes(profile, hw, knobs)
                yield predict_step_time(profile, hw, knobs)[0], peak, chunk_size, knobs


def _profiles(seed, **kwargs):
    in_backward = kwargs.pop("update_in_backward", False)
    step_bytes = kwargs.pop("optim_step_bytes_per_param", 0)
    frozen_pre = kwargs.pop("frozen_pre", False)
    gpu_update = kwargs.pop("gpu_update", 0)
    gpu_in_backward = kwargs.pop("gpu_update_in_backward", 0)
    at_step = kwargs.pop("persistent_at_step", False)
    micro = kwargs.pop("micro_batches", 1)
    accumulation = kwargs.pop("grad_accumulation", False)
    accumulate_on = kwargs.pop("accumulate_on", "cpu")
    profile = make_profile(seed=seed, **{**SMALL, **kwargs})
    profile = dataclasses.replace(
        profile,
        micro_batches=micro,
        grad_accumulation=accumulation,
        update_in_backward=in_backward,
        optim_step_bytes_per_param=step_bytes,
        gpu_update=gpu_update,
        gpu_update_in_backward=gpu_in_backward,
        persistent_at_step=at_step,
        accumulate_on=accumulate_on,
    )
    if frozen_pre:
        # No backward reads the pre unit's own chunks (a frozen embedding under LoRA).
        chunks = [dataclasses.replace(c, backward=c.units != (0,)) for c in profile.chunks]
        assert not all(c.backward for c in chunks)
        profile = dataclasses.replace(profile, chunks=tuple(chunks))
    return {profile.chunk_size: profile}


def _budgets(profiles, hw):
    """Budgets from tight to loose across the range the configurations span."""
    peaks = [row[1] for row in brute_force(profiles, hw, None)]
    return [int(np.quantile(peaks, q)) for q in (0.02, 0.2, 0.5, 0.9)]


@pytest.mark.parametrize(
    "seed, kwargs",
    [
        (0, {}),
        (1, {"lora": True}),
        (2, {"tied": True}),
        (3, {"fwd_s": 0.002}),
        (11, {"edge_bytes": 3 * SMALL["chunk_size"], "lora": True}),
        (12, {"edge_bytes": 3 * SMALL["chunk_size"], "tied": True}),
        (13, {"update_in_backward": True}),
        (14, {"update_in_backward": True, "tied": True}),
        (15, {"optim_step_bytes_per_param": 24}),
        (16, {"edge_bytes": 3 * SMALL["chunk_size"], "lora": True, "frozen_pre": True}),
        (17, {"gpu_update": -1}),
        (18, {"gpu_update": 2, "tied": True}),
        (19, {"update_in_backward": True, "gpu_update_in_backward": -1}),
        (20, {"update_in_backward": True, "gpu_update_in_backward": 2, "tied": True}),
        (21, {"update_in_backward": True, "persistent_at_step": True}),
        (22, {"update_in_backward": True, "persistent_at_step": True, "tied": True}),
        (23, {"allreduce_bps": 5e8, "update_in_backward": True, "persistent_at_step": True}),
        (24, {"allreduce_bps": 5e8, "tied": True}),
    ],
)
def test_search_returns_the_brute_force_optimum(seed, kwargs):
    kwargs = dict(kwargs)
    hw = make_hardware(h2d_bps=12e9, d2h_bps=12e9, duplex_bps=20e9)  # tight enough to trade off
    hw = replace(hw, allreduce_bps=kwargs.pop("allreduce_bps", math.inf))
    profiles = _profiles(seed, **kwargs)
    for budget in _budgets(profiles, hw):
        rows = brute_force(profiles, hw, budget)
        plan = search(profiles, hw, budget)
        best = min(row[0] for row in rows)
        if kwargs.get("gpu_update_in_backward") == -1:
            # The plan's count of GPU updates in the backward is then refined for its knobs
            # (``search._best_backward_split``): never slower than the search's estimate.
            assert plan.predicted_step_s <= best * (1 + 1e-9)
        else:
            assert plan.predicted_step_s == pytest.approx(best, rel=1e-9)
        profile = profiles[plan.chunk_size]
        assert predict_peak_bytes(profile, hw, plan.knobs) == plan.predicted_peak_bytes <= budget
        assert plan.source == "search" and plan.budget_bytes == budget


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tied": True},
        {"edge_bytes": 3 * SMALL["chunk_size"]},
        {"update_in_backward": True},
        {"optim_step_bytes_per_param": 24},
        {"edge_bytes": 3 * SMALL["chunk_size"], "lora": True, "frozen_pre": True},
        {"gpu_update": -1},
        {"gpu_update": 3, "edge_bytes": 3 * SMALL["chunk_size"]},
        {"update_in_backward": True, "gpu_update_in_backward": -1},
        {"update_in_backward": True, "gpu_update_in_backward": 3, "tied": True},
        {"update_in_backward": True, "persistent_at_step": True, "tied": True},
        {"allreduce_bps": 3e8},
        {"allreduce_bps": 3e8, "update_in_backward": True, "persistent_at_step": True},
        {"micro_batches": 4, "grad_accumulation": True},
        {"micro_batches": 3, "grad_accumulation": True, "accumulate": 4e8},
        {"micro_batches": 3, "grad_accumulation": True, "accumulate": 4e9, "gpu_update": -1},
        {"micro_batches": 2, "grad_accumulation": True, "accumulate": 1e9, "allreduce_bps": 3e8},
        {"micro_batches": 4, "grad_accumulation": True, "accumulate": 4e8, "accumulate_on": "gpu"},
        {"micro_batches": 3, "accumulate_on": "gpu", "grad_accumulation": True, "tied": True},
    ],
    ids=[
        "tied",
        "oversized",
        "update-in-backward",
        "optimizer-step",
        "frozen-pre",
        "gpu-update-auto",
        "gpu-update-3",
        "gpu-in-backward-auto",
        "gpu-in-backward-3",
        "persistent-at-step",
        "allreduce",
        "allreduce-update-in-backward",
        "accumulation-unmeasured-adds",
        "accumulation-slow-adds",
        "accumulation-gpu-update",
        "accumulation-allreduce",
        "accumulation-on-gpu",
        "accumulation-on-gpu-tied",
    ],
)
def test_vectorised_rows_equal_the_scalar_model(kwargs):
    kwargs = dict(kwargs)
    # Data parallelism's all-reduce of persistent gradients (slow enough to show past the tail).
    allreduce = kwargs.pop("allreduce_bps", math.inf)
    accumulate = kwargs.pop("accumulate", math.inf)
    hw = make_hardware(h2d_bps=8e9, d2h_bps=10e9, duplex_bps=14e9, cpu_optim_params_per_s=2e9)
    hw = replace(hw, allreduce_bps=allreduce, cpu_accumulate_params_per_s=accumulate)
    profiles = _profiles(7, **kwargs)
    profile = profiles[SMALL["chunk_size"]]
    found = search_all(profiles, hw, None)
    assert len(found) > 100
    exposed = 0
    for row in range(len(found)):
        knobs = Knobs(
            int(found.n_persist[row]),
            int(found.n_buffer[row]),
            int(found.n_swap[row]),
            int(found.n_checkpoint[row]),
        )
        assert found.peak_bytes[row] == predict_peak_bytes(profile, hw, knobs)
        step_s, breakdown, _ = predict_step_time(profile, hw, knobs)
        assert found.step_s[row] == pytest.approx(step_s, 1e-9)
        exposed += breakdown["collective_stall_s"] > 0
    assert (exposed > 0) == math.isfinite(allreduce)


def test_search_all_lists_every_feasible_config_and_the_plan_is_on_its_frontier():
    hw = make_hardware(h2d_bps=12e9, d2h_bps=12e9, duplex_bps=20e9)
    profiles = _profiles(4)
    budget = _budgets(profiles, hw)[2]
    found = search_all(profiles, hw, budget)
    assert (found.peak_bytes <= budget).all()
    # The buffers the search skips only add memory: every brute-force time is matched.
    brute = {round(row[0], 12) for row in brute_force(profiles, hw, budget)}
    assert {round(step, 12) for step in found.step_s} == brute
    plan = search(profiles, hw, budget)
    frontier = found.frontier()
    assert plan.predicted_step_s == pytest.approx(found.step_s[frontier].min())
    assert found.tokens_per_s.max() == pytest.approx(
        profiles[plan.chunk_size].batch_tokens / plan.predicted_step_s
    )


def test_a_kept_request_replans_and_lists_the_same_feasible_set():
    hw = make_hardware(h2d_bps=12e9, d2h_bps=12e9, duplex_bps=20e9)
    profiles = _profiles(4)
    budget = _budgets(profiles, hw)[2]
    request = SearchRequest(profiles, hw, budget, {"n_swap": 0})
    assert request.plan() == search(profiles, hw, budget, {"n_swap": 0})
    found = request.candidates()
    expected = search_all(profiles, hw, budget, {"n_swap": 0})
    assert len(found) == len(expected) > 0
    np.testing.assert_array_equal(found.peak_bytes, expected.peak_bytes)
    assert (found.n_swap == 0).all()


def test_search_picks_the_best_chunk_size():
    hw = make_hardware(h2d_bps=12e9, d2h_bps=12e9, duplex_bps=20e9)
    profiles = {}
    for chunk_size in (32 * MiB, 48 * MiB, 96 * MiB):
        profiles.update(_profiles(5, chunk_size=chunk_size))
    budget = _budgets({48 * MiB: profiles[48 * MiB]}, hw)[1]
    plan = search(profiles, hw, budget)
    best = min(row[0] for row in brute_force(profiles, hw, budget))
    assert plan.predicted_step_s == pytest.approx(best, rel=1e-9)
    per_size = [search({cs: p}, hw, budget).predicted_step_s for cs, p in profiles.items()]
    assert plan.predicted_step_s == pytest.approx(min(per_size))


@pytest.mark.parametrize(
    "fixed",
    [
        {"n_swap": 1},
        {"n_checkpoint": 2},
        {"n_persist": 3},
        {"n_buffer": 4},
        {"n_swap": 1, "n_checkpoint": 1},
    ],
)
def test_partial_override_is_kept_and_the_rest_searched(fixed):
    hw = make_hardware(h2d_bps=12e9, d2h_bps=12e9, duplex_bps=20e9)
    profiles = _profiles(6)
    budget = _budgets(profiles, hw)[2]
    plan = search(profiles, hw, budget, fixed)
    for name, value in fixed.items():
        assert getattr(plan, name) == value
    best = min(row[0] for row in brute_force(profiles, hw, budget, fixed))
    assert plan.predicted_step_s == pytest.approx(best, rel=1e-9)
    assert plan.source == "user+search"


def test_fully_fixed_plan_is_the_users():
    hw = make_hardware()
    profiles = _profiles(6)
    fixed = dict(chunk_size=SMALL["chunk_size"], n_persist=2, n_buffer=4, n_swap=1, n_checkpoint=1)
    plan = search(profiles, hw, None, fixed)
    assert plan.source == "user" and plan.knobs == Knobs(2, 4, 1, 1)
    assert plan.block_policies == ("swap", "checkpoint", "keep", "keep")


def test_infeasible_override_names_knob_value_budget_and_nearest_feasible():
    hw = make_hardware()
    profiles = _profiles(8)
    profile = profiles[SMALL["chunk_size"]]
    budget = _budgets(profiles, hw)[1]
    n_persist = profile.n_chunks
    with pytest.raises(PlanError) as error:
        search(profiles, hw, budget, {"n_persist": n_persist})
    message = str(error.value)
    assert f"n_persist={n_persist}" in message and format_bytes(budget) in message
    alternative = int(re.search(r"nearest feasible: n_persist=(\d+)", message).group(1))
    assert alternative < n_persist
    assert search(profiles, hw, budget, {"n_persist": alternative}).n_persist == alternative
    # It is the nearest: one more does not fit.
    with pytest.raises(PlanError):
        search(profiles, hw, budget, {"n_persist": alternative + 1})


def test_infeasible_checkpoint_override_suggests_the_nearest_checkpoint_count():
    hw = make_hardware()
    profiles = _profiles(9)
    fixed = {"n_swap": 0}
    budget = min(row[1] for row in brute_force(profiles, hw, None, fixed))
    with pytest.raises(PlanError, match=r"n_checkpoint=0.*nearest feasible: ") as error:
        search(profiles, hw, budget, {**fixed, "n_checkpoint": 0})
    found = re.search(r"n_checkpoint=(\d+) \(set AUTOOFFLOAD_N_CHECKPOINT", str(error.value))
    alternative = int(found.group(1))
    assert search(profiles, hw, budget, {**fixed, "n_checkpoint": alternative})
    with pytest.raises(PlanError):
        search(profiles, hw, budget, {**fixed, "n_checkpoint": alternative - 1})


def test_nothing_fits_reports_the_smallest_peak():
    hw = make_hardware()
    profiles = _profiles(10)
    smallest = min(row[1] for row in brute_force(profiles, hw, None))
    with pytest.raises(PlanError) as error:
        search(profiles, hw, smallest - 1)
    # Rounded up to a size that fits, in units a person reads.
    suggested = int(re.search(r"AUTOOFFLOAD_BUDGET >= (\d+)MiB", str(error.value)).group(1))
    assert smallest <= suggested * MiB < smallest + MiB
    assert format_bytes(smallest) in str(error.value)
    assert search(profiles, hw, smallest).predicted_peak_bytes == smallest


def test_a_floor_on_persistent_chunks_that_alone_keeps_plans_out_is_named():
    """A re-plan keeping the persistent chunks (``min_persist``) that fits only with fewer: the
    error names the floor and its smallest peak, not the smallest peak without it (which fits
    the budget and read as a contradiction: "nothing fits ... the smallest peak is 7 GiB")."""
    hw = make_hardware()
    profiles = _profiles(10)
    rows = brute_force(profiles, hw, None)
    floor = max(row[3].n_persist for row in rows)
    with_floor = min(row[1] for row in rows if row[3].n_persist >= floor)
    without = min(row[1] for row in rows)
    assert without < with_floor
    budget = (without + with_floor) // 2
    with pytest.raises(PlanError) as error:
        search(profiles, hw, budget, min_persist=floor)
    text = str(error.value)
    assert f"keeping the {floor} persistent chunks" in text and "plans with fewer fit" in text
    assert f"{with_floor / 2**30:.2f} GiB" in text
    assert search(profiles, hw, budget).n_persist < floor


@pytest.mark.parametrize(
    "fixed, match",
    [
        ({"n_persits": 1}, "unknown fixed knob"),
        ({"chunk_size": 1}, "chunk_size=1 was not profiled"),
        ({"n_swap": 3, "n_checkpoint": 3}, "exceeds n_blocks=4"),
        ({"n_persist": 10_000}, "n_persist=10000 is out of range"),
        ({"n_buffer": 0}, "n_buffer=0 is out of range"),
    ],
)
def test_invalid_override_is_a_plan_error(fixed, match):
    with pytest.raises(PlanError, match=match):
        search(_profiles(0), make_hardware(), None, fixed)


def test_eighty_layers_three_hundred_chunks_search_is_fast_and_sound():
    hw = make_hardware()
    profile = make_profile(
        n_blocks=80, chunk_size=256 * MiB, block_param_bytes=800 * MiB, tensors_per_block=8
    )
    assert profile.n_chunks >= 300
    budget = 40 << 30
    started = time.perf_counter()
    plan = search({profile.chunk_size: profile}, hw, budget)
    elapsed = time.perf_counter() - started
    print(f"\nsearch over 80 blocks x {profile.n_chunks} chunks took {elapsed:.2f} s")
    print(plan.summary())
    assert plan.predicted_peak_bytes <= budget
    assert predict_peak_bytes(profile, hw, plan.knobs) == plan.predicted_peak_bytes
    assert len(plan.summary().splitlines()) <= 8
    started = time.perf_counter()
    unbounded = search({profile.chunk_size: profile}, hw, None)  # nothing pruned by the budget
    print(f"unbounded search took {time.perf_counter() - started:.2f} s")
    everything_on_gpu = Knobs(profile.n_chunks, 1)
    assert unbounded.predicted_step_s <= predict_step_time(profile, hw, everything_on_gpu)[0]


def test_on_three_hundred_chunks_the_count_of_gpu_updates_in_the_backward_is_a_local_best():
    """Beyond ``EXHAUSTIVE_COUNTS`` the count is searched coarse to fine: the one taken fits
    and no neighbour is predicted faster."""
    hw = make_hardware(cpu_optim_params_per_s=1e9)
    profile = replace(
        make_profile(
            n_blocks=80, chunk_size=256 * MiB, block_param_bytes=800 * MiB, tensors_per_block=8
        ),
        update_in_backward=True,
        gpu_update_in_backward=-1,
    )
    budget = 40 << 30
    started = time.perf_counter()
    plan = search({profile.chunk_size: profile}, hw, budget)
    print(f"\nsearch with the count refined took {time.perf_counter() - started:.2f} s")
    k = plan.gpu_backward_chunks
    assert k > EXHAUSTIVE_COUNTS, "the test needs the coarse-to-fine search"
    assert plan.predicted_peak_bytes <= budget

    def step(count: int) -> float:
        return predict_step_time(replace(profile, gpu_update_in_backward=count), hw, plan.knobs)[0]

    assert plan.predicted_step_s == pytest.approx(step(k), rel=1e-12)
    assert step(k - 1) >= step(k) <= step(k + 1)


def _qlora_shaped(chunk_size: int) -> ModelProfile:
    """Llama-3-8B QLoRA shrunk: a frozen bf16 embedding and head ten times a block's size (1.05 GB
    vs ~110 MB of nf4), eight frozen 32 MiB blocks, a tiny final norm before the head; the
    adapters are resident (static bytes); activations as with a chunked loss."""
    base = make_profile(n_blocks=8, lora=True).with_batch_scaled(0.125)
    block = [(8 * MiB, False)] * 4
    tensors = [[(320 * MiB, False)], *[block] * 8, [(MiB // 16, False), (320 * MiB, False)]]
    return replace(base, chunk_size=chunk_size, chunks=layout_chunks(tensors, chunk_size))


def test_an_oversized_frozen_embedding_no_longer_forces_big_chunks_under_a_tight_budget():
    hw = make_hardware()
    small, big = _qlora_shaped(32 * MiB), _qlora_shaped(320 * MiB)
    assert [c.bytes for c in small.chunks[:2]] == [320 * MiB, 32 * MiB]
    budget = 1000 * MiB
    plan = search({32 * MiB: small, 320 * MiB: big}, hw, budget)
    assert plan.chunk_size == 32 * MiB and plan.predicted_peak_bytes <= budget
    # One oversized chunk in flight at a time beside small ones, not two embedding-sized buffers.
    assert plan.breakdown["mem_buffers_max"] < 2 * 320 * MiB
    with pytest.raises(PlanError, match="no configuration fits"):
        search({320 * MiB: big}, hw, budget)
    # The old model gave every buffer the largest chunk's size: at least min_buffers of them.
    tables = chunk_tables(small)
    old = tables.persist_bytes + small.static_bytes + tables.min_buffers * 320 * MiB
    assert hw.cuda_context_bytes + small.fragmentation_factor * old.min() > budget
    # With room for it, the search keeps the embedding on the device (no 320 MiB copy per pass).
    roomy = search({32 * MiB: small}, hw, 1300 * MiB)
    assert roomy.n_persist >= 1 and roomy.predicted_step_s < plan.predicted_step_s


def test_gpu_updates_are_chosen_when_the_cpu_update_binds_and_cost_their_scratch():
    """A slow host: the auto split moves chunks to the GPU path, every plan predicts no slower
    (k = 0 is among the splits it weighs), and the step's memory holds the scratch sets."""
    hw = make_hardware(cpu_optim_params_per_s=2e8)
    cpu_only = _profiles(5)[SMALL["chunk_size"]]
    auto = dataclasses.replace(cpu_only, gpu_update=-1)
    fixed = dataclasses.replace(cpu_only, gpu_update=1)
    tables = chunk_tables(cpu_only)
    knobs = Knobs(1, int(tables.min_buffers[1]))
    slow, _, _ = predict_step_time(cpu_only, hw, knobs)
    fast, breakdown, _ = predict_step_time(auto, hw, knobs)
    assert breakdown["gpu_update_chunks"] >= 1 and fast < slow
    # The two paths run at once: the CPU's share shrank by the chunks the GPU took.
    assert breakdown["cpu_optim_s"] < float(tables.offload_numel[1]) / hw.cpu_optim_params_per_s
    assert predict_step_time(fixed, hw, knobs)[1]["gpu_update_chunks"] == 1
    # Scratch: two sets of the largest GPU-updated chunk (weights, grads, state) at the step.
    last = cpu_only.chunks[-1]
    scratch = 2 * (2 * last.bytes + cpu_only.optim_bytes_per_param * last.trainable_numel)
    step_only = peak_breakdown(cpu_only, hw, knobs)["optimizer_step"]
    assert peak_breakdown(fixed, hw, knobs)["optimizer_step"] == step_only + scratch
    # A fast host: the CPU alone is quicker than any split (the smallest k wins ties).
    quick = make_hardware(cpu_optim_params_per_s=1e13)
    assert predict_step_time(auto, quick, knobs)[1]["gpu_update_chunks"] == 0


def test_updating_in_the_backward_is_never_predicted_slower_and_helps_cpu_bound_plans():
    hw = make_hardware(cpu_optim_params_per_s=2e8)  # a slow host: the CPU update binds
    default = _profiles(5)[SMALL["chunk_size"]]
    early = dataclasses.replace(default, update_in_backward=True)
    found = search_all({default.chunk_size: default}, hw, None)
    gains = []
    for row in range(len(found)):
        names = ("n_persist", "n_buffer", "n_swap", "n_checkpoint")
        knobs = Knobs(*(int(getattr(found, name)[row]) for name in names))
        before = predict_step_time(default, hw, knobs)[0]
        after = predict_step_time(early, hw, knobs)[0]
        assert after <= before + 1e-12, knobs
        gains.append(before - after)
    assert max(gains) > 0, "the head start in the backward never shortened a step"


def test_under_update_in_backward_the_cpu_update_overlaps_the_backwards_recompute():
    """The CPU updates the chunks whose gradients are in while the backward recomputes the
    checkpointed blocks below them: on a CPU-bound plan, checkpointing more blocks lengthens
    the backward but shortens the next forward's wait for the update as much (the model counted
    the backward's compute alone before, and predicted 3.6B's step 25-44% slow). Updating from
    step() on, the recompute adds to the step in full."""
    hw = make_hardware(cpu_optim_params_per_s=2e8)  # a slow host: the CPU update binds
    default = _profiles(5)[SMALL["chunk_size"]]
    early = dataclasses.replace(default, update_in_backward=True)
    none, four = Knobs(1, 4, 0, 0), Knobs(1, 4, 0, 4)
    (step_0, terms_0, _), (step_4, terms_4, _) = (
        predict_step_time(early, hw, knobs) for knobs in (none, four)
    )
    added = terms_4["recompute_s"] - terms_0["recompute_s"]
    assert added > 0.05 * step_0, "the test needs recompute worth a part of the step"
    assert terms_0["cpu_optim_stall_s"] > added, "the test needs a CPU-bound plan"
    assert step_4 == pytest.approx(step_0, abs=1e-9)
    shrunk = terms_0["cpu_optim_stall_s"] - terms_4["cpu_optim_stall_s"]
    assert shrunk == pytest.approx(added, rel=1e-9)
    after_step = [predict_step_time(default, hw, knobs)[0] for knobs in (none, four)]
    assert after_step[1] - after_step[0] == pytest.approx(added, rel=1e-9)


def test_gpu_updates_in_the_backward_free_the_next_forward_from_the_cpus_wait():
    """A slow host under the update in the backward: the CPU's queue ends with chunk p, the
    first the forward needs. The auto split gives the lowest chunks to the GPU: the predicted
    step is shorter, the CPU does less, and the cost lands where the model says it does: the
    chunks' state on the device in the late backward, more bytes over the link."""
    hw = make_hardware(cpu_optim_params_per_s=2e8)
    cpu_only = dataclasses.replace(_profiles(5)[SMALL["chunk_size"]], update_in_backward=True)
    auto = dataclasses.replace(cpu_only, gpu_update_in_backward=-1)
    knobs = Knobs(1, 4, 0, 0)
    slow, before, _ = predict_step_time(cpu_only, hw, knobs)
    fast, after, _ = predict_step_time(auto, hw, knobs)
    k = int(after["gpu_backward_chunks"])
    assert k >= 1 and fast < slow
    assert after["cpu_optim_stall_s"] < before["cpu_optim_stall_s"]
    on_gpu = range(1, 1 + k)  # the lowest offloaded trainable chunks (all are trainable here)
    moved = sum(cpu_only.chunks[c].trainable_numel for c in on_gpu)
    assert after["cpu_optim_s"] == pytest.approx(before["cpu_optim_s"] - moved / 2e8)
    state = sum(cpu_only.optim_bytes_per_param * cpu_only.chunks[c].trainable_numel for c in on_gpu)
    assert after["h2d_bytes"] - before["h2d_bytes"] == pytest.approx(state)
    weights = sum(cpu_only.chunks[c].bytes - cpu_only.chunks[c].trainable_bytes for c in on_gpu)
    assert after["d2h_bytes"] - before["d2h_bytes"] == pytest.approx(state + weights)
    assert peak_breakdown(auto, hw, knobs)["backward_update_scratch"] >= state / k
    assert peak_breakdown(cpu_only, hw, knobs)["backward_update_scratch"] == 0
    # A fast host: the CPU is done before the forward needs it; nothing moves to the GPU.
    quick = make_hardware(cpu_optim_params_per_s=1e13)
    assert predict_step_time(auto, quick, knobs)[1]["gpu_backward_chunks"] == 0
    # Without the update in the backward the setting is moot.
    at_step = dataclasses.replace(auto, update_in_backward=False)
    assert predict_step_time(at_step, hw, knobs)[1]["gpu_backward_chunks"] == 0


def test_the_plans_gpu_updates_in_the_backward_are_the_fastest_count_for_its_knobs():
    """The search runs with a per-n_persist estimate of the count; the plan then takes the
    count the cost model predicts fastest for the knobs it chose. Here a slow link makes the
    state's copies cost what the estimate does not see (it would send 6 chunks; 1 is best)."""
    hw = make_hardware(cpu_optim_params_per_s=2e8, h2d_bps=1e9, d2h_bps=1e9, duplex_bps=1.6e9)
    profile = dataclasses.replace(
        _profiles(5, update_in_backward=True)[SMALL["chunk_size"]], gpu_update_in_backward=-1
    )
    plan = search({profile.chunk_size: profile}, hw, None, fixed={"n_persist": 1, "n_swap": 0})
    trainable = sum(1 for c in profile.chunks[plan.n_persist :] if c.trainable_numel > 0)
    steps = {
        k: predict_step_time(
            dataclasses.replace(profile, gpu_update_in_backward=k), hw, plan.knobs
        )[0]
        for k in range(trainable + 1)
    }
    best = min(steps, key=lambda k: (steps[k], k))
    assert plan.gpu_backward_chunks == best
    assert plan.predicted_step_s == pytest.approx(steps[best], rel=1e-9)
    estimate = predict_step_time(profile, hw, plan.knobs)[1]["gpu_backward_chunks"]
    assert estimate != best, "the test needs an estimate the refinement improves on"


# ---- checkpoint inputs on the host ----------------------------------------------------------


def _long_context(n_blocks: int = 16) -> ModelProfile:
    """LoRA-like (frozen blocks, no weight grads), with checkpoint inputs as big as a long
    sequence makes them (a quarter of a block's keep)."""
    base = make_profile(
        n_blocks=n_blocks, chunk_size=48 * MiB, block_param_bytes=64 * MiB, lora=True
    )
    blocks = tuple(replace(u, act_bytes_checkpoint=u.act_bytes_keep // 4) for u in base.blocks)
    return replace(base, blocks=blocks)


def test_checkpoint_inputs_on_cpu_leave_only_in_flight_inputs_on_the_device():
    hw = make_hardware()
    profile = _long_context()
    on_cpu = with_checkpoint_inputs_on_cpu(profile, hw)
    assert on_cpu.checkpoint_inputs_on_cpu and not profile.checkpoint_inputs_on_cpu
    c = profile.blocks[0].act_bytes_checkpoint
    assert on_cpu.blocks[0].act_bytes_checkpoint == 0
    assert on_cpu.blocks[0].bwd_transient_bytes == profile.blocks[0].bwd_transient_bytes + 2 * c
    assert on_cpu.blocks[0].bwd_s == pytest.approx(profile.blocks[0].bwd_s + c / hw.h2d_bps)
    assert (on_cpu.pre, on_cpu.post) == (profile.pre, profile.post)
    all_ckpt = Knobs(profile.n_chunks, 1, 0, profile.n_blocks)
    saved = sum(u.act_bytes_checkpoint for u in profile.blocks)
    drop = predict_peak_bytes(profile, hw, all_ckpt) - predict_peak_bytes(on_cpu, hw, all_ckpt)
    # Every saved input but the ~3 in flight leaves the device.
    assert drop >= profile.fragmentation_factor * (saved - 4 * c)
    step_gpu = predict_step_time(profile, hw, all_ckpt)[0]
    step_cpu = predict_step_time(on_cpu, hw, all_ckpt)[0]
    assert 0 < step_cpu - step_gpu <= 2.01 * saved / hw.h2d_bps


def test_auto_checkpoint_inputs_take_the_faster_feasible_layout():
    hw = make_hardware()
    profile = _long_context()
    profiles = {profile.chunk_size: profile}
    on_cpu_only = {profile.chunk_size: with_checkpoint_inputs_on_cpu(profile, hw)}
    # A budget only the host-side inputs fit: the smallest GPU-input peak, less a little.
    smallest_gpu = int(search_all(profiles, hw, None).peak_bytes.min())
    budget = smallest_gpu - 8 * MiB
    with pytest.raises(PlanError, match="no configuration fits"):
        search(profiles, hw, budget)
    plan = search(profiles, hw, budget, checkpoint_inputs="auto")
    assert "checkpoint_cpu" in plan.block_policies and plan.predicted_peak_bytes <= budget
    assert plan.knobs == search(on_cpu_only, hw, budget).knobs
    assert "(inputs on CPU)" in plan.summary()
    # Unbounded, recompute is not needed and the inputs stay where they are.
    roomy = search(profiles, hw, None, checkpoint_inputs="auto")
    assert "checkpoint_cpu" not in roomy.block_policies
    # auto is never slower than either layout alone, at any budget.
    for budget in (None, smallest_gpu, 2 * smallest_gpu):
        steps = [
            search(profiles, hw, budget, checkpoint_inputs=where).predicted_step_s
            for where in ("gpu", "cpu")
        ]
        auto = search(profiles, hw, budget, checkpoint_inputs="auto").predicted_step_s
        assert auto == pytest.approx(min(steps))
    found = search_all(profiles, hw, budget, checkpoint_inputs="auto")
    assert len(found) == len(search_all(profiles, hw, budget)) + len(
        search_all(on_cpu_only, hw, budget)
    )


def test_a_host_short_of_room_keeps_the_first_blocks_inputs_and_the_device_the_rest():
    """The host holds only some blocks' inputs: the variant moves the first k of them (their
    inputs wait longest), its plans name only those ``checkpoint_cpu``, its peak lies between
    the device-only and host-only layouts', and the running variant reproduces the plan's
    prediction (what calibration and the OOM retry re-derive)."""
    from autooffload.plan.replan import running_variant

    hw = make_hardware()
    profile = _long_context(n_blocks=8)
    part = with_checkpoint_inputs_on_cpu(profile, hw, 3)
    assert part.host_input_blocks == 3 and part.checkpoint_inputs_on_cpu
    assert [u.act_bytes_checkpoint == 0 for u in part.blocks] == [True] * 3 + [False] * 5
    assert part.blocks[5] == profile.blocks[5]
    knobs = Knobs(0, 2, 0, profile.n_blocks)
    peaks = [
        predict_peak_bytes(p, hw, knobs)
        for p in (profile, part, with_checkpoint_inputs_on_cpu(profile, hw))
    ]
    assert peaks[0] > peaks[1] > peaks[2]
    profiles = {profile.chunk_size: profile}
    budget = peaks[1] + 4 * MiB
    no_swap = {"n_swap": 0}
    plan = search(profiles, hw, budget, no_swap, checkpoint_inputs="auto", host_input_blocks=3)
    policies = plan.block_policies
    assert plan.host_input_blocks == 3 and plan.predicted_peak_bytes <= budget
    assert [p == "checkpoint_cpu" for p in policies] == [True] * 3 + [False] * 5
    assert set(policies[3:]) <= {"checkpoint", "keep"}
    assert "(inputs on CPU: blocks 0-2; on the GPU: blocks 3-" in plan.summary()
    again = make_plan(running_variant(profile, plan, hw), hw, plan.knobs, budget)
    assert again.predicted_peak_bytes == plan.predicted_peak_bytes
    assert again.block_policies == policies
    # No room at all: the device alone, as checkpoint_inputs=gpu.
    none = search(profiles, hw, None, checkpoint_inputs="auto", host_input_blocks=0)
    assert none.knobs == search(profiles, hw, None).knobs and none.host_input_blocks == 0


def test_swapped_blocks_and_host_kept_inputs_share_the_hosts_room():
    """Swapped blocks' saved tensors and checkpointed blocks' host-kept inputs both sit in host
    memory: the search keeps their sum within ``host_room``, trading swaps for recompute or
    keeps; it is the plan's ``host_activation_bytes``; where only plans over the room fit the
    device, the error names host memory (a swap that filled the host was killed, not told)."""
    hw = make_hardware()
    profile = _long_context(n_blocks=8)
    keep, inputs = profile.blocks[0].act_bytes_keep, profile.blocks[0].act_bytes_checkpoint
    profiles = {profile.chunk_size: profile}
    tight = 800 * MiB  # the smallest peak is ~798 MiB: 7 blocks swapped, 1 checkpointed
    free = search(profiles, hw, tight, checkpoint_inputs="auto")
    assert free.n_swap == 7 and free.block_policies[-1] == "checkpoint_cpu"
    assert free.host_activation_bytes == 7 * keep + inputs
    for room in (300 * MiB, 200 * MiB, 100 * MiB):
        plan = search(profiles, hw, tight, checkpoint_inputs="auto", host_room=room)
        swapped = plan.block_policies.count("swap")
        on_host = plan.block_policies.count("checkpoint_cpu")
        assert plan.host_activation_bytes == swapped * keep + on_host * inputs <= room
        assert plan.predicted_peak_bytes <= tight
        assert plan.predicted_step_s > free.predicted_step_s  # recompute instead of swaps
        assert f"{format_bytes(plan.host_activation_bytes)} of them held on the host" in (
            plan.summary()
        )
    # Every candidate listed is within the room too.
    roomy = search_all(profiles, hw, None, checkpoint_inputs="auto")
    bounded = search_all(profiles, hw, None, checkpoint_inputs="auto", host_room=2 * keep)
    assert 0 < len(bounded) < len(roomy) and bounded.n_swap.max() == 2
    # No room: nothing on the host; the only plans that fit the tight budget need it.
    unbounded = search(profiles, hw, None, checkpoint_inputs="auto", host_room=0)
    assert unbounded.host_activation_bytes == 0 and unbounded.n_swap == 0
    with pytest.raises(PlanError, match=r"more activations in host memory than the 0 B .*7 blocks"):
        search(profiles, hw, tight, checkpoint_inputs="auto", host_room=0)
    with pytest.raises(PlanError, match=r"than the 200 MiB available .*8 blocks swapped"):
        search(profiles, hw, None, {"n_swap": 8}, host_room=200 * MiB)


def test_invalid_checkpoint_inputs_is_a_plan_error():
    profile = make_profile()
    with pytest.raises(PlanError, match=r"checkpoint_inputs='disk' is not valid; valid: \('auto'"):
        search({profile.chunk_size: profile}, make_hardware(), None, checkpoint_inputs="disk")


def test_a_plan_moving_checkpoint_inputs_to_the_host_is_a_different_configuration():
    hw = make_hardware()
    profile = _long_context()
    knobs = Knobs(0, 2, 0, profile.n_blocks)
    on_gpu = make_plan(profile, hw, knobs, None)
    on_cpu = make_plan(with_checkpoint_inputs_on_cpu(profile, hw), hw, knobs, None)
    # Same counts (a re-plan comparing only knobs would keep the old policies) ...
    assert on_gpu.knobs == on_cpu.knobs
    # ... but not the same configuration: calibration and the OOM retry must apply it.
    assert not on_gpu.configures_like(on_cpu)
    assert on_gpu.configures_like(make_plan(profile, hw, knobs, None))


def test_a_calibration_changing_only_the_gpu_update_split_is_a_different_configuration():
    """The split follows from the CPU rate: a calibrated rate can move chunks between the paths
    with every knob the same, and the runtime must switch to it (not report it only)."""
    profile = dataclasses.replace(_profiles(5)[SMALL["chunk_size"]], gpu_update=-1)
    knobs = Knobs(1, int(chunk_tables(profile).min_buffers[1]))
    slow = make_plan(profile, make_hardware(cpu_optim_params_per_s=1e10), knobs, None)
    slower = make_plan(profile, make_hardware(cpu_optim_params_per_s=2e9), knobs, None)
    assert slow.knobs == slower.knobs
    assert slower.gpu_update_chunks > slow.gpu_update_chunks >= 1
    assert not slower.configures_like(slow)
    assert "updated on the GPU" in slower.summary()
