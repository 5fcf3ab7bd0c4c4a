"""``resize_token_embeddings`` on an attached model resizes it as on a plain one and trains like
plain; after an optimizer was built over it, it is a clear error."""

from __future__ import annotations

import pytest
import torch
from runtime.runtime_models import CHUNK_SIZE, batches, enable_cpu, tiny_llama

import autooffload
from autooffload import runtime as rt
from autooffload.errors import AttachError

NEW_VOCAB = 136


def _resize_then_train(how: str | None, tied: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Resize the tiny Llama's vocabulary (plain, or attached ``how``), then train 3 steps."""
    model = tiny_llama(tied=tied)
    if how == "enable":
        enable_cpu(n_persist=0)
        model.to("cpu")
    elif how == "attach":
        autooffload.attach(model, device="cpu", chunk_size=CHUNK_SIZE, n_persist=0)
    torch.manual_seed(5)  # the added rows are drawn around the old rows' mean
    model.resize_token_embeddings(NEW_VOCAB)
    assert (rt.runtime_of(model) is not None) == (how is not None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    if how == "attach":
        autooffload.attach(model, optimizer)
    losses = []
    for ids in batches(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    autooffload.disable()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("how", ["enable", "attach"])
def test_resizing_an_attached_model_trains_like_resizing_a_plain_one(how: str, tied: bool):
    plain_losses, plain = _resize_then_train(None, tied)
    losses, weights = _resize_then_train(how, tied)
    assert plain["model.embed_tokens.weight"].shape[0] == NEW_VOCAB
    assert losses == plain_losses
    assert weights.keys() == plain.keys()
    for name, value in plain.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0, msg=name)


def test_resizing_after_the_optimizer_was_built_is_a_clear_error():
    enable_cpu(n_persist=0)
    model = tiny_llama().to("cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # held, as a script holds it
    with pytest.raises(AttachError, match="resize before creating the optimizer"):
        model.resize_token_embeddings(NEW_VOCAB)
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()  # the model is left as it was
    optimizer.step()
