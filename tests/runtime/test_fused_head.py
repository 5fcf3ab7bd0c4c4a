"""The LM head fused with the loss: an attached model trains exactly as plain autograd while no
tensor of the logits' size is ever made; it applies only where the model's forward goes straight
from its head to its loss, and says so."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

import autooffload
from autooffload import runtime as rt
from autooffload.errors import AttachError
from autooffload.runtime import host_vocab
from autooffload.runtime.activations import fused_head
from autooffload.runtime.activations.head_source import forward_check
from tests.runtime import test_host_vocab as vocab_test
from tests.runtime.runtime_models import enable_cpu
from tests.runtime.test_offload_equivalence import Run, adamw, assert_same_training, train

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 4


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of a few rows, so the tiny model's head runs in several."""
    monkeypatch.setattr(fused_head, "FUSED_CHUNK_BYTES", 4 * 4 * 128)  # 4 rows at vocab 128


@pytest.mark.parametrize("n_persist", [0, None], ids=["streamed", "planned"])
def test_fused_head_trains_like_plain_autograd(
    make_llama, make_batches, offload_cpu, small_chunks, n_persist
):
    base = make_llama(tied=False)
    data = make_batches(STEPS)
    plain = train(copy.deepcopy(base), data, attach=None, offload_cpu=offload_cpu)
    steps = []

    def check(runtime) -> None:
        steps.append(runtime.fused_head.fused_steps)

    attach = {"fused_head": True}
    if n_persist is not None:
        attach["n_persist"] = n_persist
    fused = train(
        copy.deepcopy(base), data, attach=attach, offload_cpu=offload_cpu, before_detach=check
    )
    assert steps == [STEPS]
    assert_same_training(plain, fused)


def test_lora_with_a_served_head_fuses_it_from_the_host_store(monkeypatch):
    """LoRA under a tight budget: the frozen head is served from the host store, and each pass
    of the fused loss (its forward, its backward) brings its weight to the device once, in the
    profiling steps and the planned ones; it trains as plain PEFT."""
    monkeypatch.setattr(host_vocab, "HEAD_TILE_BYTES", 240 * 64 * 4)  # 18 tiles
    monkeypatch.setattr(fused_head, "FUSED_CHUNK_BYTES", 5 * 4 * vocab_test.VOCAB)  # 5 rows
    base = vocab_test._llama()
    plain = vocab_test._train(vocab_test._lora(copy.deepcopy(base)), None)
    passes = []
    original = host_vocab.served_head_pass

    def counted(module):
        one_pass = original(module)
        if one_pass is None:
            return None

        def counting():
            passes.append(1)
            return one_pass()

        return counting

    monkeypatch.setattr(host_vocab, "served_head_pass", counted)
    tiles = []
    monkeypatch.setattr(
        host_vocab._TiledHead, "apply", lambda *a: tiles.append(1) or pytest.fail("tiles")
    )
    attached = vocab_test._train(
        vocab_test._lora(copy.deepcopy(base)), {"budget": "1600KiB", "fused_head": True}
    )
    vocab_test._assert_same(plain, attached)
    runtime, served = attached[2]
    last = len(runtime.layout.chunks) - 1
    assert all(last in s for s in served)
    assert runtime.fused_head.fused_steps == vocab_test.STEPS
    # One copy of the head a pass (forward and backward of each step), none tile by tile.
    assert len(passes) == 2 * vocab_test.STEPS and not tiles


class _Largest(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.stride() and min(tensor.stride()) > 0:
                self.nbytes = max(self.nbytes, tensor.numel() * tensor.element_size())
        return out


def test_no_tensor_of_the_logits_size_is_made(small_chunks):
    """With the head fused, the largest tensor any op makes in a training step (the chunk
    buffers included) is a quarter of the logits' (tokens x vocab) bytes or less; without it,
    the logits themselves are made."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).train()
    ids = torch.randint(0, config.vocab_size, (2, 64))
    logits_bytes = ids.numel() * config.vocab_size * 4

    def largest(fused: bool) -> int:
        enable_cpu(fused_head=fused, n_persist=0)
        probe = copy.deepcopy(model)
        probe.to("cpu")
        with _Largest() as mode:
            out = probe(input_ids=ids, labels=ids)
            out.loss.backward()
        assert (out.logits is None) == fused
        autooffload.disable()
        return mode.nbytes

    assert largest(False) >= logits_bytes
    assert largest(True) <= logits_bytes // 4


def test_outside_training_the_logits_are_made(make_llama, make_batches, offload_cpu):
    model = make_llama(tied=False)
    ids = make_batches(1)[0]
    offload_cpu(fused_head=True, n_persist=0)
    model.to("cpu")
    with torch.no_grad():
        assert model(input_ids=ids, labels=ids).logits is not None
    model.eval()
    assert model(input_ids=ids, labels=ids).logits is not None
    model.train()
    assert model(input_ids=ids).logits is not None
    out = model(input_ids=ids, labels=ids, return_dict=False)
    assert out[1] is None and out[0].requires_grad
    # The head is wrapped only while a fused forward runs: a copy between steps (PEFT's
    # modules_to_save of a resident head) is a plain module.
    assert "forward" not in model.lm_head.__dict__


def test_auto_fuses_where_the_logits_take_a_quarter_of_the_budget(
    make_llama, make_batches, offload_cpu
):
    model = make_llama(tied=False)
    ids = make_batches(1)[0]
    logits_bytes = ids.numel() * model.config.vocab_size * 4
    offload_cpu(n_persist=0, budget=4 * logits_bytes + 4096)
    model.to("cpu")
    assert model(input_ids=ids, labels=ids).logits is not None
    autooffload.disable()
    offload_cpu(n_persist=0, budget=4 * logits_bytes - 4096)
    model = make_llama(tied=False)
    model.to("cpu")
    assert model(input_ids=ids, labels=ids).logits is None
    assert rt.runtime_of(model).fused_head.fused_steps == 1


def test_forward_check_reads_what_the_forward_does():
    """Forwards that pass the head's output straight to the loss qualify; soft-capping (Gemma 2)
    does not."""
    assert forward_check(LlamaForCausalLM) is None
    assert "before the loss" in forward_check(Gemma2ForCausalLM)

    class Scaled(LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            hidden = self.model(input_ids=input_ids).last_hidden_state
            logits = self.lm_head(hidden)
            return self.loss_function(logits=logits * 2, labels=labels, vocab_size=1)

    assert "is not given the head's output" in forward_check(Scaled)

    class Logged(LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            hidden = self.model(input_ids=input_ids).last_hidden_state
            logits = self.lm_head(hidden)
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=1) + logits.mean()
            return loss

    assert "beside the loss call" in forward_check(Logged)


def test_on_for_a_model_it_cannot_fuse_is_an_error_at_attach(offload_cpu):
    config = Gemma2Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    model = Gemma2ForCausalLM(config)
    offload_cpu(fused_head=True, n_persist=0)
    with pytest.raises(AttachError, match="AUTOOFFLOAD_FUSED_HEAD=1.*before the loss"):
        model.to("cpu")


def test_a_loss_function_set_on_the_model_is_a_clear_error(make_llama, make_batches, offload_cpu):
    model = make_llama(tied=False)
    ids = make_batches(1)[0]
    offload_cpu(fused_head=True, n_persist=0)
    model.to("cpu")
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.float().mean()
    with pytest.raises(RuntimeError, match="AUTOOFFLOAD_FUSED_HEAD=0"):
        model(input_ids=ids, labels=ids)


def test_the_setting_parses_and_rejects(monkeypatch):
    for value, expected in (("auto", None), ("0", False), ("on", True)):
        monkeypatch.setenv("AUTOOFFLOAD_FUSED_HEAD", value)
        assert autooffload.Settings.from_env().fused_head is expected
    monkeypatch.setenv("AUTOOFFLOAD_FUSED_HEAD", "sometimes")
    with pytest.raises(autooffload.SettingsError, match="AUTOOFFLOAD_FUSED_HEAD"):
        autooffload.Settings.from_env()


def test_under_bf16_autocast_the_gradients_match_plain(
    make_llama, make_batches, small_chunks, chunk_count
):
    """fp32 weights under CPU bf16 autocast: the loss within bf16 rounding, every gradient
    within the matmul's bf16 sums (the head's weight gradient is summed over chunks in fp32)."""
    base = make_llama(tied=False)
    ids = make_batches(1)[0]
    every = chunk_count(base)  # all persistent: the gradients stay in .grad

    def step(fused: bool | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model = copy.deepcopy(base)
        if fused is not None:
            enable_cpu(fused_head=fused, n_persist=every)
            model.to("cpu")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=ids, labels=ids)
        assert (out.logits is None) == bool(fused)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        if fused is not None:
            autooffload.disable()
        return out.loss.detach(), grads

    plain_loss, plain = step(None)
    loss, fused = step(True)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-5)
    assert fused.keys() == plain.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(fused[name], grad, rtol=2e-2, atol=2e-3, msg=name)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_gradient_accumulation_trains_like_plain(
    make_llama, make_batches, offload_cpu, small_chunks, tied
):
    """Two micro-batches per optimizer step, clipped: every micro-batch is fused, and their
    head gradients (the weight shared with the embedding, when tied) add up as plain ones do."""
    base = make_llama(tied=tied)
    data = make_batches(2 * STEPS)
    kw = {"accum": 2, "clip": 0.5}
    plain = train(copy.deepcopy(base), data, attach=None, offload_cpu=offload_cpu, **kw)
    steps = []
    fused = train(
        copy.deepcopy(base),
        data,
        attach={"fused_head": True, "n_persist": 0},
        offload_cpu=offload_cpu,
        before_detach=lambda runtime: steps.append(runtime.fused_head.fused_steps),
        **kw,
    )
    assert steps == [2 * STEPS]
    assert_same_training(plain, fused)


def _padded(ids: torch.Tensor, step: int) -> torch.Tensor:
    """Labels of ``ids`` with -100 over a prefix of row 0 (its length by step) and all of row 1."""
    labels = ids.clone()
    labels[0, : 3 + step] = -100
    labels[1:] = -100
    return labels


def _train_with(model, data, *, attach, offload_cpu, forward_kw) -> tuple[Run, int | None]:
    """One AdamW step per batch of ``model(input_ids=ids, **forward_kw(ids, step))``; the run
    and, attached, its fused steps."""
    if attach is not None:
        offload_cpu(**attach)
        model.to("cpu")
    optimizer = adamw(model.parameters())
    losses = []
    for step, ids in enumerate(data):
        loss = model(input_ids=ids, **forward_kw(ids, step)).loss
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    fused_steps = None
    if attach is not None:
        fused_steps = rt.runtime_of(model).fused_head.fused_steps
        autooffload.disable()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Run(losses, [], weights), fused_steps


def _same_as_plain(make_llama, make_batches, offload_cpu, forward_kw) -> None:
    base = make_llama(tied=False)
    data = make_batches(STEPS)
    plain, _ = _train_with(
        copy.deepcopy(base), data, attach=None, offload_cpu=offload_cpu, forward_kw=forward_kw
    )
    fused, steps = _train_with(
        copy.deepcopy(base),
        data,
        attach={"fused_head": True, "n_persist": 0},
        offload_cpu=offload_cpu,
        forward_kw=forward_kw,
    )
    assert steps == STEPS
    assert_same_training(plain, fused)


@pytest.mark.parametrize("num_items", [None, 20, torch.tensor(20)], ids=["mean", "int", "tensor"])
def test_ignored_labels_and_the_callers_item_count_train_like_plain(
    make_llama, make_batches, offload_cpu, small_chunks, num_items
):
    """Labels with -100 (a prefix of one row, the whole other row) and the loss divided by
    the caller's ``num_items_in_batch`` (as the Trainer passes it), or by the kept labels:
    the fused loss and training are plain's."""

    def forward_kw(ids, step):
        kw = {"labels": _padded(ids, step)}
        if num_items is not None:
            kw["num_items_in_batch"] = num_items
        return kw

    _same_as_plain(make_llama, make_batches, offload_cpu, forward_kw)


def test_shift_labels_given_by_the_caller_train_like_plain(
    make_llama, make_batches, offload_cpu, small_chunks
):
    """``shift_labels`` given beside ``labels`` are the targets (transformers does not shift
    them): here other targets than the shifted labels, with ignored positions."""

    def forward_kw(ids, step):
        return {"labels": ids, "shift_labels": _padded(ids.flip(-1), step)}

    _same_as_plain(make_llama, make_batches, offload_cpu, forward_kw)


@pytest.mark.parametrize("size", ["resident", "chunked"])
@pytest.mark.parametrize("order", ["peft_then_move", "move_then_peft"])
def test_lora_on_every_linear_fuses_the_frozen_head_and_trains_like_plain_peft(
    monkeypatch, small_chunks, order, size
):
    """PEFT LoRA on ``all-linear`` (the head left frozen), adapters resident or chunked, the
    PeftModel attached or the base attached before PEFT wraps it: every step is fused and
    the adapters train as in plain PEFT."""
    from tests.peft import peft_runs

    monkeypatch.setenv("AUTOOFFLOAD_FUSED_HEAD", "1")
    base = peft_runs.tiny_llama(size)
    data = peft_runs.batches(STEPS)
    plain = peft_runs.run(base, peft_runs.lora(), "plain", size, data)
    model = peft_runs.wrap(copy.deepcopy(base), peft_runs.lora(), order, size)
    losses = peft_runs.train(model, data)
    assert peft_runs.runtime_for(model).fused_head.fused_steps == STEPS
    autooffload.disable()
    peft_runs.assert_same_training(plain, peft_runs.Run(losses, peft_runs.trained_weights(model)))
