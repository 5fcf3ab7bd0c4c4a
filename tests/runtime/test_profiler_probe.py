"""The profiling step's block probe (runtime/control/profiler.py), in the CPU simulation: it runs
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
    block.register_forward_pre_hook(
        lambda module, args: seen.append(runtime.step_state.hooks_muted)
    )
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
    from autooffload.runtime.control.probe import PROBE_RUNS

    assert seen.count(True) == PROBE_RUNS
    assert seen[-1] is False and not runtime.step_state.hooks_muted
    assert runtime.plan.source.startswith("search") and losses[-1] < losses[0]


def test_a_step_of_micro_batches_is_profiled_on_its_first_and_counted(
    make_llama, offload_cpu, make_batches
):
    """Under gradient accumulation the profiling step runs several forwards and backwards:
    the pre and post units are timed on the first micro-batch (the last forward's end against
    the first backward's start read a negative post forward, and the plan's compute went
    negative), and the profile says how many micro-batches a step has."""
    model = make_llama(n_layers=2)
    offload_cpu()
    model.to("cpu")
    runtime = rt.runtime_of(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = make_batches(9)
    for step in range(3):  # two profiling steps, then the plan's: 3 micro-batches each
        for ids in batches[3 * step : 3 * step + 3]:
            (model(input_ids=ids, labels=ids).loss / 3).backward()
        optimizer.step()
        optimizer.zero_grad()
    profile = runtime.profile
    assert profile is not None and profile.micro_batches == 3 and profile.grad_accumulation
    for unit in (profile.pre, profile.post):
        assert unit.fwd_s >= 0 and unit.bwd_s >= 0, unit
    assert profile.batch_tokens == batches[0].numel()  # one micro-batch's
    assert "3 micro-batches of accumulation" in runtime.plan.summary()
