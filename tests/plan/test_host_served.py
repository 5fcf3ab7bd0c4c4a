"""Chunks served from the host (a frozen embedding's rows, a frozen head's tiles) in the cost
model: counted nowhere on the device, weighed against gathering them whole, chosen by cost."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from plan_profiles import llama8b_lora_profile, make_hardware

from autooffload.errors import PlanError
from autooffload.plan.configuration import with_served_chunks_gathered
from autooffload.plan.cost_memory import peak_breakdown
from autooffload.plan.profile_types import ModelProfile
from autooffload.plan.residency import chunk_tables, prefetch_queue
from autooffload.plan.search import search, search_all
from autooffload.plan.types import GiB, Knobs

HEAD = 33


def _search(profile: ModelProfile, budget: int | None):
    return search({profile.chunk_size: profile}, make_hardware(), budget, checkpoint_inputs="auto")


def _floor(profile: ModelProfile) -> float:
    candidates = search_all(
        {profile.chunk_size: profile}, make_hardware(), None, checkpoint_inputs="auto"
    )
    return float(np.min(candidates.peak_bytes))


def test_a_served_chunk_is_on_the_device_nowhere():
    served = llama8b_lora_profile(served=True)
    tables = chunk_tables(served)
    block = served.chunks[1].bytes
    # The head's unit holds no chunk of its own; the last block's is all that is live there.
    assert tables.resident_bytes[0, HEAD] == 0
    assert tables.resident_bytes[0, HEAD - 1] == block
    assert tables.persist_bytes[1] == 0  # "persistent" chunk 0 is served: no device bytes
    assert HEAD not in prefetch_queue(served, 0, HEAD - 1, forward=True)
    assert 0 not in prefetch_queue(served, 0, 0, forward=True)
    gathered = with_served_chunks_gathered(served, make_hardware())
    assert chunk_tables(gathered).resident_bytes[0, HEAD] == gathered.chunks[HEAD].bytes


def test_gathered_variant_takes_the_serving_out_of_its_units():
    hw = make_hardware()
    served = llama8b_lora_profile(served=True)
    gathered = with_served_chunks_gathered(served, hw)
    head = served.chunks[HEAD]
    assert not any(c.served for c in gathered.chunks)
    assert gathered.post.fwd_s == pytest.approx(
        served.post.fwd_s - head.served_fwd_bytes / hw.h2d_bps
    )
    assert gathered.post.bwd_s == pytest.approx(
        served.post.bwd_s - head.served_bwd_bytes / hw.h2d_bps
    )
    tiles = head.served_device_bytes
    assert gathered.post.fwd_transient_bytes == served.post.fwd_transient_bytes - tiles
    assert gathered.post.bwd_transient_bytes == served.post.bwd_transient_bytes - tiles
    gathered.validate()


@pytest.mark.parametrize("nf4", [False, True])
def test_serving_lowers_the_floor_by_about_the_head(nf4):
    served = llama8b_lora_profile(nf4=nf4, served=True)
    gathered = with_served_chunks_gathered(served, make_hardware())
    saved = _floor(gathered) - _floor(served)
    # The head (1.05 GB) leaves the device and two 64 MiB tiles come; with bf16 blocks the
    # floor then lies where a 436 MB block and the loss's rows meet (2.42 -> 1.96 GiB).
    assert saved > 0.4 * served.chunks[HEAD].bytes


def test_search_serves_under_a_tight_budget_and_counts_it():
    served = llama8b_lora_profile(nf4=True, served=True)
    budget = int(2.25 * GiB)
    plan = _search(served, budget)
    assert plan.host_served_chunks == (0, HEAD)
    assert plan.predicted_peak_bytes <= budget
    knobs = plan.knobs
    assert plan.predicted_peak_bytes == peak_breakdown(served, make_hardware(), knobs)["peak"]
    # Gathering whole fits nowhere under that budget.
    with pytest.raises(PlanError, match="no configuration fits"):
        _search(with_served_chunks_gathered(served, make_hardware()), budget)


def test_search_gathers_when_memory_allows_and_gathering_is_faster():
    served = llama8b_lora_profile(served=True)
    plan = _search(served, None)
    assert plan.host_served_chunks == ()
    assert plan.n_persist == served.n_chunks  # everything resident: no copies at all


def test_served_fields_round_trip_and_are_checked():
    served = llama8b_lora_profile(served=True)
    assert ModelProfile.from_dict(served.to_dict()) == served
    chunks = list(served.chunks)
    chunks[0] = replace(chunks[0], trainable_bytes=2, trainable_numel=1)
    with pytest.raises(PlanError, match="served from the host but trains"):
        replace(served, chunks=tuple(chunks)).validate()


def test_a_served_persistent_chunk_costs_nothing():
    served = llama8b_lora_profile(served=True)
    hw = make_hardware()
    low = peak_breakdown(served, hw, Knobs(0, 2, 0, 32))["peak"]
    assert peak_breakdown(served, hw, Knobs(1, 2, 0, 32))["peak"] == low


@pytest.mark.parametrize("budget", [None, int(2.25 * GiB)])
def test_a_running_plan_is_predicted_on_the_variant_it_was_searched_on(budget):
    """The OOM retry and the bench predict a running plan on ``profile_for_plan``'s variant:
    the served chunks gathered whole when the plan gathers them, as served when it serves."""
    from autooffload.runtime.control.planning import profile_for_plan

    hw = make_hardware()
    served = llama8b_lora_profile(nf4=True, served=True)
    plan = _search(served, budget)
    assert bool(plan.host_served_chunks) is (budget is not None)
    variant = profile_for_plan(served, plan, hw)
    assert any(c.served for c in variant.chunks) is bool(plan.host_served_chunks)
    assert peak_breakdown(variant, hw, plan.knobs)["peak"] == plan.predicted_peak_bytes
