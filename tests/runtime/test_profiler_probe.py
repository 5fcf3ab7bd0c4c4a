"""The profiling step's block probe (autooffload/plan/profile.py), in the CPU simulation: it runs
each block through its ``__call__`` with the runtime's hooks stepping aside, and every block of
the profile carries what the probe measured, the checkpoint cost included."""

from __future__ import annotations

import pytest
import torch

from autooffload import runtime as rt
from autooffload.plan.profile import StepProfiler

pytestmark = pytest.mark.usefixtures("one_thread")


def test_every_block_carries_the_probes_checkpoint_cost(
    make_llama, offload_cpu, make_batches, monkeypatch
):
    # On CPU the checkpointed run is not timed (None: the forward's time stands); here it
    # returns a marker, which each block's profile must carry.
    calls = []

    def checkpointed(self, block, args, kwargs, params, kept_s):
        calls.append((type(block).__name__, self.runtime.hooks_muted))
        return 0.125

    monkeypatch.setattr(StepProfiler, "_probe_checkpointed", checkpointed)
    model = make_llama(n_layers=4)
    offload_cpu()
    model.to("cpu")
    runtime = rt.runtime_of(model)
    seen = []

    def pre_hook(module, args):
        seen.append(runtime.hooks_muted)

    block = next(g.module for g in runtime.groups if g.is_block)
    block.register_forward_pre_hook(pre_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for ids in make_batches(3):  # two profiling steps, then the searched plan
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    profile = runtime.profile
    assert profile is not None and len(profile.blocks) == 4
    assert [b.recompute_s for b in profile.blocks] == [0.125] * 4
    assert all(b.checkpoint_cost_s == 0.125 for b in profile.blocks)
    # One block class, probed once, with the hooks muted; the probe went through __call__
    # (the block's own forward pre-hook saw it, muted), and the hooks are live again.
    assert calls == [(type(block).__name__, True)]
    assert True in seen and seen[-1] is False
    assert not runtime.hooks_muted
