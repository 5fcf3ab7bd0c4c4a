"""A frozen embedding's rows and a frozen head's tiles served from the host store: LoRA trains
as plain PEFT does, the planner serves them under a tight budget, and only frozen, untied,
oversized vocabulary weights qualify."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import autooffload
from autooffload import runtime as rt
from autooffload.runtime import host_vocab
from autooffload.runtime.control.planning import model_state_peak

VOCAB = 4096
STEPS = 5
# A block is ~150 KB and the 1 MiB embedding and head are chunks of their own, as Llama-3-8B's
# 1.05 GB vocabulary beside 436 MB blocks.
CHUNK_SIZE = 200_000
# fp32 both ways; the head's input gradient is summed over tiles in another order (~1e-7
# relative), which AdamW's normalisation can lift to ~1e-5 on near-zero adapter gradients.
RTOL = ATOL = 5e-5


def _llama(tied: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config).train()


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2, 16), generator=generator) for _ in range(STEPS)]


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(5)  # the adapters' init
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear")
    return get_peft_model(model, config)


def _train(model: torch.nn.Module, attach: dict | None) -> tuple[list[float], dict, object]:
    """Train ``STEPS`` AdamW steps; with ``attach`` under ``autooffload.enable(**attach)``."""
    if attach is not None:
        autooffload.enable(
            device="cpu",
            force_attach=True,
            chunk_size=CHUNK_SIZE,
            mask=False,
            log="warning",
            **attach,
        )
    try:
        model = model.to("cpu")
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-2)
        losses, served = [], []
        runtime = rt.registry.runtime_of(model)
        for batch in _batches():
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if runtime is not None:
                served.append(runtime.host_vocab.served)
        trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        return losses, trained, (runtime, served)
    finally:
        if attach is not None:
            autooffload.disable()


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    # 240 rows of 256 B per tile: 18 tiles over the 4096 rows, the last one short.
    monkeypatch.setattr(host_vocab, "HEAD_TILE_BYTES", 240 * 64 * 4)


def _assert_same(plain: tuple, attached: tuple) -> None:
    assert attached[0] == pytest.approx(plain[0], rel=RTOL, abs=ATOL)
    for name, value in plain[1].items():
        torch.testing.assert_close(attached[1][name], value, rtol=RTOL, atol=ATOL, msg=name)


def test_lora_with_the_vocabulary_served_trains_like_plain_peft():
    base = _llama()
    plain = _train(_lora(copy.deepcopy(base)), None)
    attached = _train(_lora(copy.deepcopy(base)), {"budget": "1600KiB"})
    _assert_same(plain, attached)
    runtime, served = attached[2]
    last = len(runtime.layout.chunks) - 1
    # The profiling steps serve both; the plan searched under the tight budget keeps them so.
    assert all(s == {0, last} for s in served)
    plan = runtime.plan
    assert plan.host_served_chunks == (0, last)
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert "served from host memory: chunks 0, " in plan.summary("cpu")


def test_unbounded_plan_gathers_the_vocabulary_and_still_trains_alike():
    base = _llama()
    plain = _train(_lora(copy.deepcopy(base)), None)
    attached = _train(_lora(copy.deepcopy(base)), {})
    _assert_same(plain, attached)
    runtime, served = attached[2]
    assert served[0] and not served[-1]  # served while profiling, gathered once searched
    assert runtime.plan.host_served_chunks == ()


def test_served_head_is_exact_per_tile_and_in_autograd():
    model = _lora(_llama())
    reference = copy.deepcopy(model)
    runtime = autooffload.attach(model, device="cpu", chunk_size=CHUNK_SIZE, n_persist=0)
    try:
        head = model.base_model.model.lm_head
        assert "forward" in head.__dict__  # served while profiling
        x = torch.randn(2, 7, 64, requires_grad=True)
        out = head(x)
        ref_x = x.detach().clone().requires_grad_(True)
        ref = reference.base_model.model.lm_head(ref_x)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        grad = torch.randn_like(out)
        out.backward(grad)
        ref.backward(grad)
        torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-6, atol=1e-6)
        embed = model.base_model.model.model.embed_tokens
        ids = torch.randint(0, VOCAB, (3, 5))
        torch.testing.assert_close(
            embed(ids), reference.base_model.model.model.embed_tokens(ids), rtol=0, atol=0
        )
        assert sorted(runtime.host_vocab.served) == [0, len(runtime.layout.chunks) - 1]
    finally:
        rt.detach(model)
    assert "forward" not in head.__dict__ and "forward" not in embed.__dict__


def test_full_fine_tuning_and_tied_vocabularies_are_gathered():
    model = _llama()  # embedding and head train
    runtime = autooffload.attach(model, device="cpu", chunk_size=CHUNK_SIZE, n_persist=0)
    try:
        assert runtime.host_vocab.servable == {}
        assert runtime.plan.host_served_chunks == ()
    finally:
        rt.detach(model)
    tied = _lora(_llama(tied=True))
    runtime = autooffload.attach(tied, device="cpu", chunk_size=CHUNK_SIZE, n_persist=0)
    try:
        assert runtime.host_vocab.servable == {}
    finally:
        rt.detach(tied)


def test_unfreezing_a_served_weight_gathers_it_again():
    model = _lora(_llama())
    runtime = autooffload.attach(model, device="cpu", chunk_size=CHUNK_SIZE, n_persist=0)
    try:
        head_chunk = len(runtime.layout.chunks) - 1
        assert head_chunk in runtime.host_vocab.served
        model.base_model.model.lm_head.weight.requires_grad_(True)
        runtime.host_vocab.serve(runtime.plan.host_served_chunks)
        assert head_chunk not in runtime.host_vocab.served
    finally:
        rt.detach(model)


def test_the_attach_floor_counts_a_served_vocabulary_as_its_tiles():
    """A budget between the smallest plan's weights with the vocabulary served (two head tiles)
    and with it gathered whole is accepted at attach, and trains: the profiling steps serve it."""
    autooffload.enable(device="cpu", force_attach=True, chunk_size=CHUNK_SIZE, mask=False)
    try:
        model = _lora(_llama()).to("cpu")
        runtime = rt.registry.runtime_of(model)
        chunks = runtime.layout.chunks
        widest = max(len(v) for v in runtime.layout.chunks_of_group.values())
        served = {i: c.bytes_for(0).device for i, c in runtime.host_vocab.servable.items()}
        assert sorted(served) == [0, len(chunks) - 1]  # the embedding and the head
        gathered_floor = model_state_peak(chunks, 0, widest)
        served_floor = model_state_peak(chunks, 0, widest, served)
        assert served_floor < gathered_floor
    finally:
        autooffload.disable()
    budget = gathered_floor - 1  # the old floor refused it
    losses, _, (runtime, served_steps) = _train(_lora(_llama()), {"budget": budget})
    assert runtime is not None and len(losses) == STEPS
    assert served_steps[0] == frozenset(served)
