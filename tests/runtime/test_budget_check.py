"""A budget no plan can fit is refused at attach, before any update, in sizes a person reads."""

from __future__ import annotations

import pytest
import torch
from runtime.runtime_models import batches, enable_cpu, tiny_llama

from autooffload import runtime as rt
from autooffload.errors import PlanError


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


def test_a_budget_above_the_weights_but_below_the_batch_names_the_size_it_needs():
    enable_cpu(n_persist=None, budget="200KiB")
    model = tiny_llama()
    model.to("cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    with pytest.raises(PlanError, match=r"budget of 200 KiB.*AUTOOFFLOAD_BUDGET >= \d+MiB"):
        for ids in batches(4):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
