"""Evaluation and generation on an attached model, before training, between steps and between a
backward and its step (a sanity ``generate`` before fine-tuning, Trainer's periodic eval): the
same losses and tokens as the plain model, and the plan is profiled on the training batch, not on
what ran before it."""

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


def _inference_calls(model: torch.nn.Module) -> list:
    """Generation options and evaluation forwards a script runs on its model, as tensors."""
    val = batches(1, seed=9)[0]
    prompt = val[:, :4]
    padded = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 9]])
    mask = (padded != 0).long()
    torch.manual_seed(5)
    with torch.no_grad():
        hidden = model(input_ids=val, output_hidden_states=True).hidden_states
        embeds = model(inputs_embeds=model.get_input_embeddings()(val), labels=val)
    scored = model.generate(
        prompt, max_new_tokens=3, return_dict_in_generate=True, output_scores=True
    )
    return [
        model.generate(prompt, max_new_tokens=4, do_sample=True, top_k=20),
        model.generate(prompt, max_new_tokens=4, num_beams=3, num_return_sequences=2),
        model.generate(prompt, max_new_tokens=4, use_cache=False),
        model.generate(prompt, max_new_tokens=4, cache_implementation="static"),
        model.generate(padded, attention_mask=mask, max_new_tokens=4, pad_token_id=0),
        scored.sequences,
        *scored.scores,
        *hidden,
        embeds.loss,
        embeds.logits,
    ]


def test_generation_options_between_backward_and_step_match_the_plain_model():
    """Sampling, beam search, static and no cache, left padding, scores, hidden states and an
    ``inputs_embeds`` forward, run after a backward and before its ``step()`` (in the profiling
    step and after the plan): the plain model's outputs, and training goes on as plain."""
    runs = []
    for attached in (False, True):
        if attached:
            enable_cpu(n_persist=0)
        model = tiny_llama(tied=False).to("cpu")
        assert (rt.runtime_of(model) is not None) == attached
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        seen = []
        for step, ids in enumerate(batches(4)):
            model(input_ids=ids, labels=ids).loss.backward()
            if step in (0, 3):
                model.eval()
                seen += _inference_calls(model)
                model.train()
            optimizer.step()
            optimizer.zero_grad()
        seen += [p.detach().clone() for p in model.state_dict().values()]
        runs.append(seen)
        autooffload.disable()
    for want, got in zip(*runs, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
