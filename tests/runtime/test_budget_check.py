"""A budget no plan can fit is refused at attach, before any update, in sizes a person reads."""

from __future__ import annotations

import re

import pytest
import torch
from runtime.runtime_models import batches, enable_cpu, tiny_llama

import autooffload
from autooffload import runtime as rt
from autooffload.errors import PlanError
from autooffload.runtime.control.planning import model_state_peak


def test_a_budget_below_the_weights_alone_is_refused_at_attach_before_any_update():
    enable_cpu(n_persist=None, budget="4KiB")
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    with pytest.raises(PlanError) as info:
        model.to("cpu")
    message = str(info.value)
    for words in ("AUTOOFFLOAD_BUDGET", "4.00 KiB", "KiB the model's weights", "MiB"):
        assert words in message, message
    assert "bytes" not in message and "\n" not in message
    assert rt.runtime_of(model) is None
    assert not optimizer.state and all(
        torch.equal(v, before[k]) for k, v in model.state_dict().items()
    )


def test_a_budget_above_the_weights_but_below_the_batch_stops_before_the_first_update():
    """The weights fit, the batch's activations do not: the first step's optimizer.step()
    searches that step's profile and raises before any weight or optimizer state changed."""
    enable_cpu(n_persist=None, budget="200KiB")
    model = tiny_llama()
    model.to("cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    (ids,) = batches(1)
    model(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(PlanError) as info:
        optimizer.step()
    message = str(info.value)
    assert message.startswith("before the first update: no configuration fits the budget of 200")
    assert re.search(r"AUTOOFFLOAD_BUDGET >= \d+MiB", message), message
    assert not optimizer.state
    # The refused search is kept (and recorded by the bench): searched again offline, it fails
    # alike, and finds a plan under a budget the message names.
    from dataclasses import replace

    from autooffload.bench.peer_autooffload import _planned_from, search_request_from_dict

    runtime = rt.runtime_of(model)
    refused = runtime.control.refused_request
    assert refused is not None and runtime.search_request is None
    with pytest.raises(PlanError, match="no configuration fits the budget of 200"):
        refused.plan()
    needed = int(re.search(r"AUTOOFFLOAD_BUDGET >= (\d+)MiB", message).group(1)) << 20
    assert replace(refused, budget_bytes=needed).plan().predicted_peak_bytes <= needed
    recorded = _planned_from(runtime, None)
    again = search_request_from_dict(recorded["search_request"], recorded["hardware"])
    assert again.budget_bytes == refused.budget_bytes
    autooffload.disable()
    fresh = tiny_llama()
    for name, value in fresh.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_a_budget_the_batch_fits_trains_past_the_first_update_check():
    enable_cpu(n_persist=None, budget="8MiB")
    model = tiny_llama()
    model.to("cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for ids in batches(4):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert rt.last_plan().source.startswith("search")


def _profiling_plan(budget: int | str) -> tuple[int, int, list]:
    """The profiling plan's buffers, one block's chunks and the layout, under ``budget``."""
    enable_cpu(n_persist=None, budget=budget)
    try:
        model = tiny_llama().to("cpu")
        runtime = rt.runtime_of(model)
        widest = max(len(v) for v in runtime.layout.chunks_of_group.values())
        return runtime.plan.n_buffer, widest, runtime.layout.chunks
    finally:
        autooffload.disable()


def test_the_profiling_steps_stream_through_one_block_of_buffers_under_a_tight_budget():
    n_buffer, widest, chunks = _profiling_plan("8MiB")
    assert n_buffer == 2 * widest  # two blocks in flight, the copy overlapping compute
    two_blocks = model_state_peak(chunks, 0, 2 * widest)
    assert model_state_peak(chunks, 0, widest) < two_blocks
    # Two blocks' buffers would take more than half the budget: the batch needs the rest.
    n_buffer, _, _ = _profiling_plan(2 * two_blocks - 1)
    assert n_buffer == widest
    n_buffer, _, _ = _profiling_plan(2 * two_blocks)
    assert n_buffer == 2 * widest
