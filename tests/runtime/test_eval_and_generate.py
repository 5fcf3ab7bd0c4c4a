"""Evaluation and generation on an attached model, before and between training steps (a sanity
``generate`` before fine-tuning, Trainer's periodic eval): the same losses and tokens as the
plain model, and the plan is profiled on the training batch, not on what ran before it."""

from __future__ import annotations

import copy

import pytest
import torch

import autooffload
from autooffload import runtime as rt
from tests.runtime.runtime_models import batches, enable_cpu, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")
EVAL_AT = (0, 2, 5)  # before the profiling steps, between them and the plan, and after


def _run(attached: bool) -> tuple[list, rt.Runtime | None]:
    base = tiny_llama(tied=False)
    if attached:
        enable_cpu(n_persist=0)
    model = copy.deepcopy(base).to("cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    val = batches(1, seed=9)[0]
    seen: list = []
    for step, ids in enumerate(batches(8)):
        if step in EVAL_AT:
            model.eval()
            with torch.no_grad():
                seen.append(model(input_ids=val, labels=val).loss.item())
            tokens = model.generate(val[:, :4], max_new_tokens=5, do_sample=False)
            seen.append(tokens.tolist())
            model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seen.append(loss.item())
    return seen, rt.runtime_of(model)


def test_eval_and_generate_between_steps_match_the_plain_model_and_leave_the_profile_alone():
    expected, _ = _run(attached=False)
    actual, runtime = _run(attached=True)
    assert runtime is not None and "search" in runtime.plan.source
    # The profile is the training batch's (2 x 16 tokens), not generate's 4-token prompt.
    assert runtime.profile.batch_tokens == 2 * 16
    hidden = runtime.model.config.hidden_size
    assert runtime.profile.blocks[0].act_bytes_checkpoint == 2 * 16 * hidden * 4
    autooffload.disable()
    assert len(actual) == len(expected)
    for want, got in zip(expected, actual, strict=True):
        if isinstance(want, list):
            assert got == want  # greedy tokens
        else:
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
