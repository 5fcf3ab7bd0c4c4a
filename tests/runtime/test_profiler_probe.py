"""The profiling step's block probe (autooffload/plan/profile.py), in the CPU simulation: it runs
each block class once through its ``__call__`` (so the hooks of HF and others run, as in the
step) with the runtime's own hooks stepping aside (no trace entry, no gather of their own)."""

from __future__ import annotations

import pytest
import torch

from autooffload import runtime as rt

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_probe_runs_blocks_through_call_with_the_runtimes_hooks_muted(
    make_llama, offload_cpu, make_batches
):
    model = make_llama(n_layers=4)
    offload_cpu()
    model.to("cpu")
    runtime = rt.runtime_of(model)
    seen: list[bool] = []
    block = next(g.module for g in runtime.groups if g.is_block)
    block.register_forward_pre_hook(lambda module, args: seen.append(runtime.hooks_muted))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for ids in make_batches(4):  # two profiling steps, then the searched plan
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert runtime.profile is not None and len(runtime.profile.blocks) == 4
    # The block's own pre-hook saw the probe's runs (muted; PROBE_RUNS of them) between the
    # steps' calls (not muted): the probe went through __call__, and the hooks are live again.
    from autooffload.plan.profile import PROBE_RUNS

    assert seen.count(True) == PROBE_RUNS
    assert seen[-1] is False and not runtime.hooks_muted
    assert runtime.plan.source.startswith("search") and losses[-1] < losses[0]
