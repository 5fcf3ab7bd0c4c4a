"""What the backward copies in: the post part's chunks (final norm, head) stay on the device from
their forward into the backward that starts with them, and a group no backward runs through (a
frozen embedding under LoRA) is neither gathered nor prefetched there. Training is unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from runtime_models import batches, enable_cpu, tiny_llama

from autooffload import runtime as rt
from autooffload.runtime import host_vocab
from autooffload.runtime.chunks.store import Residency

pytestmark = pytest.mark.usefixtures("one_thread")


def _copies_by_phase(runtime: rt.Runtime) -> dict[str, list[int]]:
    """Record every chunk copied in, by whether a backward was running."""
    copies: dict[str, list[int]] = {"forward": [], "backward": []}
    start = runtime.manager._start_copy_in

    def recording(index: int) -> None:
        in_backward = torch._C._current_graph_task_id() != -1
        copies["backward" if in_backward else "forward"].append(index)
        start(index)

    runtime.manager._start_copy_in = recording  # type: ignore[method-assign]
    return copies


def _chunks_of(runtime: rt.Runtime, name_suffix: str) -> set[int]:
    group = next(g for g in runtime.groups if g.name.endswith(name_suffix))
    return set(runtime.layout.chunks_of_group[group.index])


def _step(model: torch.nn.Module, ids: torch.Tensor, optimizer: torch.optim.Optimizer) -> float:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _plain_and_attached() -> tuple[list[float], torch.nn.Module, torch.optim.Optimizer]:
    """Plain training's losses on ``batches(3)``, and an untied tiny Llama attached under a fixed
    plan (nothing persistent, activations kept) with its optimizer, not yet stepped."""
    base = tiny_llama(tied=False)
    plain = copy.deepcopy(base)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    plain_losses = [_step(plain, ids, plain_opt) for ids in batches(3)]
    enable_cpu(n_persist=0, n_buffer=64, activation_mode="keep")
    model = base.to("cpu")
    return plain_losses, model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _post_chunks(runtime: rt.Runtime) -> set[int]:
    """The post part's chunks: the final norm (sharing a chunk with the last block), the head."""
    return _chunks_of(runtime, "model.norm") | _chunks_of(runtime, "lm_head")


def test_the_head_is_copied_in_once_per_step_and_training_is_unchanged():
    plain_losses, model, optimizer = _plain_and_attached()
    runtime, data = rt.runtime_of(model), batches(3)
    post = _post_chunks(runtime)
    blocks = set().union(*(_chunks_of(runtime, f"layers.{i}") for i in range(3))) - post
    losses = [_step(model, data[0], optimizer)]  # the first forward traces the group order
    copies = _copies_by_phase(runtime)
    losses += [_step(model, ids, optimizer) for ids in data[1:]]

    assert post and post <= set(copies["forward"])
    assert not post & set(copies["backward"]), "the head was fetched again for the backward"
    assert blocks <= set(copies["backward"]), "the blocks' backward must fetch their chunks"
    assert all(state == Residency.HOST for state in runtime.manager.state)
    torch.testing.assert_close(losses, plain_losses, rtol=1e-5, atol=1e-6)


def test_a_forward_without_backward_does_not_leave_the_head_on_the_device():
    plain_losses, model, optimizer = _plain_and_attached()
    runtime, data = rt.runtime_of(model), batches(3)
    losses = [_step(model, data[0], optimizer)]
    post = _post_chunks(runtime)
    model(input_ids=data[1])  # grad enabled, no backward: norm and head are kept for one...
    kept = {i for i, s in enumerate(runtime.manager.state) if s != Residency.HOST}
    assert kept == post, kept
    # ...the next forward drops them alone: no interrupted-step recovery (under data
    # parallelism that would discard the pending gradient reductions).
    recoveries = []
    release_all = runtime.manager.release_all
    runtime.manager.release_all = lambda: (recoveries.append(1), release_all())[1]
    losses += [_step(model, ids, optimizer) for ids in data[1:]]
    assert not recoveries
    assert all(state == Residency.HOST for state in runtime.manager.state)
    torch.testing.assert_close(losses, plain_losses, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        model(input_ids=data[0])  # no backward can follow: nothing is kept
    assert all(state == Residency.HOST for state in runtime.manager.state)


@pytest.mark.parametrize("input_grads", [True, False], ids=["input-require-grads", "plain"])
def test_a_frozen_embedding_is_not_fetched_for_the_backward(input_grads, monkeypatch):
    # The embedding gathered whole, as plans that do not serve it from the host have it
    # (runtime/host_vocab.py; tests/runtime/test_host_vocab.py).
    monkeypatch.setattr(host_vocab, "_servable", lambda *args: "")
    base, data = tiny_llama(tied=False), batches(3)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    torch.manual_seed(0)  # the adapters' init
    plain = get_peft_model(copy.deepcopy(base), config)
    if input_grads:
        plain.enable_input_require_grads()
    plain_opt = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-2)
    plain_losses = [_step(plain, ids, plain_opt) for ids in data]

    # Chunks smaller than the 16 KB embedding: it gets a chunk of its own.
    enable_cpu(n_persist=0, n_buffer=64, activation_mode="keep", chunk_size=8_000)
    torch.manual_seed(0)
    model = get_peft_model(base, config)
    if input_grads:
        # PEFT's hook makes the embedding's output require grad: a leaf, no backward through it.
        model.enable_input_require_grads()
    model.to("cpu")
    runtime = rt.runtime_of(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = [_step(model, data[0], optimizer)]
    copies = _copies_by_phase(runtime)
    losses += [_step(model, ids, optimizer) for ids in data[1:]]

    embedding_group = next(g for g in runtime.groups if g.name.endswith("embed_tokens"))
    embedding = _chunks_of(runtime, "embed_tokens")
    assert embedding_group.index in runtime.hooks.backward_free
    assert not any(g.is_block for g in runtime.groups if g.index in runtime.hooks.backward_free)
    only_embedding = {
        i for i in embedding if set(runtime.layout.chunks[i].groups) == {embedding_group.index}
    }
    assert only_embedding and only_embedding <= set(copies["forward"])
    assert not only_embedding & set(copies["backward"]), copies["backward"]
    torch.testing.assert_close(losses, plain_losses, rtol=1e-5, atol=1e-6)


def test_a_profiling_step_does_not_keep_the_head():
    # Its plan is not costed, and the loss's transients come on top of what is kept: the head
    # goes after its forward and is fetched again, as before; the searched plan keeps it.
    enable_cpu(n_persist=0, n_buffer=64)
    model = tiny_llama(tied=False).to("cpu")
    runtime = rt.runtime_of(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    post = _post_chunks(runtime)
    copies = _copies_by_phase(runtime)
    steps = []
    for ids in batches(3):
        profiling = runtime.control.profiling
        copies["backward"].clear()
        _step(model, ids, optimizer)
        steps.append((profiling, bool(post & set(copies["backward"]))))
    assert steps[0] == (True, True), steps
    assert steps[-1] == (False, False), steps


def test_the_profile_marks_the_frozen_embedding_no_backward_reads():
    # The planner costs what the runtime does: the profiled chunk of the frozen embedding has
    # backward=False (no backward gather, not in the backward prefetch queue); block chunks not.
    enable_cpu(chunk_size=8_000)  # searched plan: the profiling steps build the profile
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(tiny_llama(tied=False), config)
    model.enable_input_require_grads()
    model.to("cpu")
    runtime = rt.runtime_of(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for ids in batches(3):
        _step(model, ids, optimizer)
    assert runtime.profile is not None
    embedding = _chunks_of(runtime, "embed_tokens")
    flags = [chunk.backward for chunk in runtime.profile.chunks]
    assert embedding and not any(flags[i] for i in embedding), flags
    assert all(flags[i] for i in range(len(flags)) if i not in embedding), flags
