"""enable() sends HF causal-LM losses through the chunked loss; disable() restores the property."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
from transformers.modeling_utils import PreTrainedModel

import autooffload
from autooffload.errors import SettingsError
from autooffload.runtime.activations import chunked_ce


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config)


def batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 300, (2, 40), generator=generator)
    labels = ids.clone()
    labels[:, :9] = -100
    return {"input_ids": ids, "labels": labels}


def train_step(model: LlamaForCausalLM, **kwargs) -> tuple[torch.Tensor, torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    out = model(**batch(), **kwargs)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return out.loss.detach(), out.logits.detach(), grads


def called_chunked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts calls of the chunked loss and makes its chunks small enough to need several."""
    calls: list[int] = []
    original = chunked_ce.ChunkedCrossEntropy.apply

    def counting(logits, targets, ignore_index, chunk_rows):
        calls.append(chunk_rows)
        return original(logits, targets, ignore_index, 7)

    monkeypatch.setattr(chunked_ce.ChunkedCrossEntropy, "apply", counting)
    return calls


@pytest.mark.parametrize("num_items", [None, torch.tensor(55)], ids=["mean", "num_items"])
def test_enabled_model_loss_and_grads_equal_transformers(monkeypatch, num_items):
    model = tiny_llama()
    kwargs = {} if num_items is None else {"num_items_in_batch": num_items}
    expected_loss, expected_logits, expected_grads = train_step(model, **kwargs)
    calls = called_chunked(monkeypatch)
    autooffload.enable(device="cpu")
    loss, logits, grads = train_step(model, **kwargs)
    assert len(calls) == 1
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-6)
    assert torch.equal(logits, expected_logits)  # outputs.logits is untouched
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_disable_restores_the_property_and_the_mapping_is_never_touched(monkeypatch):
    descriptor = PreTrainedModel.__dict__["loss_function"]
    autooffload.enable(device="cpu")
    assert PreTrainedModel.__dict__["loss_function"] is not descriptor
    assert LOSS_MAPPING["ForCausalLM"] is ForCausalLMLoss  # Trainer compares by identity
    autooffload.disable()
    assert PreTrainedModel.__dict__["loss_function"] is descriptor
    calls = called_chunked(monkeypatch)
    train_step(tiny_llama())
    assert calls == []


def test_chunked_loss_off_leaves_transformers_alone(monkeypatch):
    """Off with the fused head off: the property is untouched. Off with the fused head on
    auto: the property is wrapped (for the fused head's placeholder logits), and a model's
    loss is transformers' own."""
    descriptor = PreTrainedModel.__dict__["loss_function"]
    monkeypatch.setenv("AUTOOFFLOAD_CHUNKED_LOSS", "0")
    monkeypatch.setenv("AUTOOFFLOAD_FUSED_HEAD", "0")
    autooffload.enable(device="cpu")
    assert PreTrainedModel.__dict__["loss_function"] is descriptor
    autooffload.disable()
    monkeypatch.setenv("AUTOOFFLOAD_FUSED_HEAD", "auto")
    calls = called_chunked(monkeypatch)
    autooffload.enable(device="cpu")
    assert PreTrainedModel.__dict__["loss_function"] is not descriptor
    model = tiny_llama()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    out = model(input_ids=ids, labels=ids)
    expected = ForCausalLMLoss(out.logits, ids, model.config.vocab_size)
    assert calls == [] and torch.equal(out.loss, expected)


def test_invalid_env_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("AUTOOFFLOAD_CHUNKED_LOSS", "maybe")
    with pytest.raises(SettingsError, match="AUTOOFFLOAD_CHUNKED_LOSS='maybe' is invalid"):
        autooffload.enable(device="cpu")


def test_a_custom_loss_function_is_kept_and_the_setter_still_works(monkeypatch):
    calls = called_chunked(monkeypatch)
    autooffload.enable(device="cpu")
    model = tiny_llama()
    seen: list[torch.Size] = []

    def custom(logits, labels, vocab_size, **kwargs):
        seen.append(logits.shape)
        return logits.float().mean()

    model.loss_function = custom
    assert model._loss_function is custom  # went through transformers' setter
    model(**batch())
    assert seen == [torch.Size([2, 40, 300])] and calls == []
