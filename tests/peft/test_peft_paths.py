"""PEFT's own code paths on an attached model: ``modules_to_save``, several adapters, the
``disable_adapter()`` context, merging, ``add_weighted_adapter``; each touches weights outside
a block's forward."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import get_peft_model, prepare_model_for_kbit_training

import autooffload
from autooffload.errors import AttachError
from tests.peft.peft_runs import (
    Run,
    adamw,
    assert_same_training,
    batches,
    enable_cpu,
    lora,
    run,
    runtime_for,
    tiny_llama,
    train,
    wrap,
)

# Merged (W + BA) and unmerged (Wx + BAx) forwards differ by fp32 rounding of the sum order:
# ~1e-7 relative per element, a few 1e-6 on logits of magnitude ~1 after 3 layers.
MERGE_ATOL = 1e-4
MERGE_RTOL = 1e-4


@pytest.mark.parametrize(
    ("size", "order"),
    [
        ("resident", "peft_then_move"),
        ("resident", "move_then_peft"),
        ("chunked", "peft_then_move"),
    ],
)
def test_modules_to_save_lm_head_matches_plain(size, order):
    """A trainable full copy of lm_head: with small adapters it stays resident with them (and,
    created after attach, off the original's chunk); on the tiny model the trainable share is
    over a tenth and it follows the full fine-tuning path in a chunk of its own."""
    base, data = tiny_llama(size), batches()
    config = lora(modules_to_save=["lm_head"])
    model = wrap(copy.deepcopy(base), config, order, size)
    runtime = runtime_for(model)
    copy_weight = model.base_model.model.lm_head.modules_to_save["default"].weight
    assert copy_weight.requires_grad
    assert runtime.owns(copy_weight) == (size == "chunked")
    autooffload.disable()
    assert_same_training(
        run(base, config, "plain", size, data), run(base, config, order, size, data)
    )


@pytest.mark.parametrize(
    ("order", "added"),
    [
        ("peft_then_move", "after_attach"),
        ("move_then_peft", "after_attach"),
        ("peft_then_move", "before_attach"),
    ],
)
def test_a_second_adapter_set_active_after_attach_trains_like_plain(order, added):
    """``set_adapter`` switches which adapter trains; an inactive adapter present at attach is
    frozen then, and must stay resident so that it can train once it is switched on."""

    def add_second(model):
        torch.manual_seed(7)
        model.add_adapter("second", lora(r=4, use_dora=True))

    base, data = tiny_llama(), batches(8)
    runs = []
    for kind in ("plain", order):
        early = add_second if added == "before_attach" else None
        model = wrap(copy.deepcopy(base), lora(), kind, "resident", before_move=early)
        if added == "after_attach":
            add_second(model)
        model.set_adapter("second")
        losses = train(model, data)
        model.set_adapter("default")
        default_logits = model(input_ids=data[0]).logits.detach()
        autooffload.disable()
        weights = {n: p.detach().clone() for n, p in model.named_parameters() if "lora" in n}
        runs.append((losses, weights, default_logits))
    (plain_losses, plain_w, plain_default), (losses, weights, default) = runs
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_losses))
    assert plain_w.keys() == weights.keys()
    for name in plain_w:
        torch.testing.assert_close(weights[name], plain_w[name], msg=name)
    torch.testing.assert_close(default, plain_default)


def test_disable_adapter_forward_equals_the_base_model():
    base, data = tiny_llama(), batches(5)
    reference = base(input_ids=data[0]).logits.detach()
    model = wrap(copy.deepcopy(base), lora(use_dora=True), "peft_then_move", "resident")
    train(model, data[1:])
    with torch.no_grad():
        adapted = model(input_ids=data[0]).logits
        with model.disable_adapter():
            disabled = model(input_ids=data[0]).logits
    assert (adapted - reference).abs().max() > 1e-3, "the adapters did not change the output"
    torch.testing.assert_close(disabled, reference, rtol=0, atol=0)


@pytest.mark.parametrize("variant", [{}, {"use_dora": True}], ids=["lora", "dora"])
@pytest.mark.parametrize("size", ["resident", "chunked"])
def test_merge_after_training_gives_the_unmerged_outputs(variant, size):
    base, data = tiny_llama(size), batches(6)
    ids = data[0]
    model = wrap(copy.deepcopy(base), lora(**variant), "peft_then_move", size)
    train(model, data[1:])
    with torch.no_grad():
        unmerged = model(input_ids=ids).logits.clone()
        model.merge_adapter()
        merged = model(input_ids=ids).logits.clone()
        with model.disable_adapter():  # unmerges inside the forward of each layer
            disabled = model(input_ids=ids).logits.clone()
        model.merge_adapter()
        remerged = model(input_ids=ids).logits.clone()
        model.unmerge_adapter()
        back = model(input_ids=ids).logits.clone()
        unloaded = model.merge_and_unload()
        after_unload = unloaded(input_ids=ids).logits.clone()
    reference = base(input_ids=ids).logits.detach()
    close = {"rtol": MERGE_RTOL, "atol": MERGE_ATOL}
    assert (unmerged - reference).abs().max() > 1e-3, "the adapters did not change the output"
    torch.testing.assert_close(merged, unmerged, **close)
    torch.testing.assert_close(disabled, reference, **close)
    torch.testing.assert_close(remerged, unmerged, **close)
    torch.testing.assert_close(back, unmerged, **close)
    torch.testing.assert_close(after_unload, unmerged, **close)
    autooffload.disable()
    # The merged weights are in the model handed back at detach.
    torch.testing.assert_close(unloaded(input_ids=ids).logits, unmerged, **close)


def _train_then_combine(base, order, combination, data):
    """Train two adapters, combine them with ``add_weighted_adapter``, train the combination.
    Attached, the first adapter is in chunks, the second (added after attach) resident."""
    model = wrap(copy.deepcopy(base), lora(), order, "chunked")
    losses = train(model, data[:3])
    torch.manual_seed(7)
    model.add_adapter("second", lora())
    model.set_adapter("second")
    losses += train(model, data[3:5])
    model.add_weighted_adapter(["default", "second"], [0.7, -0.5], "mix", combination)
    model.set_adapter("mix")
    losses += train(model, data[5:])
    autooffload.disable()
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if "lora" in n}
    return Run(losses, weights)


@pytest.mark.parametrize("combination", ["linear", "svd"])
def test_add_weighted_adapter_of_adapters_in_chunks_matches_plain(combination):
    """Adapters over a tenth of the bytes live in chunks; combining them reads every source
    adapter's weights outside any forward."""
    base, data = tiny_llama("chunked"), batches(8)
    assert_same_training(
        _train_then_combine(base, "plain", combination, data),
        _train_then_combine(base, "peft_then_move", combination, data),
    )


def test_add_weighted_adapter_cat_of_adapters_in_chunks_is_refused():
    model = wrap(tiny_llama("chunked"), lora(), "peft_then_move", "chunked")
    model.add_adapter("second", lora())
    train(model, batches(1))
    with pytest.raises(AttachError, match="combination_type='cat'"):
        model.add_weighted_adapter(["default", "second"], [1.0, 1.0], "mix", "cat")
    assert "mix" not in model.peft_config


def _step(model, optimizer, ids, reference=None):
    loss = model(input_ids=ids, labels=ids).loss
    if reference is not None:
        loss = loss + reference
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _lora_weights(model):
    autooffload.disable()
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora" in n}


@pytest.mark.parametrize("order", ["peft_then_move", "move_then_peft"])
def test_two_adapters_trained_alternately_then_one_deleted_match_plain(order):
    """``set_adapter`` before every step, one optimizer per adapter, then ``delete_adapter``
    and training on with the other."""
    base, data = tiny_llama(), batches(8)
    runs = []
    for kind in ("plain", order):
        model = wrap(copy.deepcopy(base), lora(), kind, "resident")
        torch.manual_seed(7)
        model.add_adapter("second", lora(r=4, use_dora=True))
        optimizers = {
            name: torch.optim.AdamW(
                [p for n, p in model.named_parameters() if f".{name}." in n], lr=1e-2
            )
            for name in ("default", "second")
        }
        losses = []
        for i, ids in enumerate(data[:6]):
            name = ("default", "second")[i % 2]
            model.set_adapter(name)
            losses.append(_step(model, optimizers[name], ids))
        model.delete_adapter("default")
        assert model.active_adapters == ["second"]
        losses += [_step(model, optimizers["second"], ids) for ids in data[6:]]
        runs.append(Run(losses, _lora_weights(model)))
    assert not any(".default." in n for n in runs[1].adapters)
    assert_same_training(*runs)


@pytest.mark.parametrize(
    ("size", "order"),
    [("resident", "move_then_peft"), ("chunked", "peft_then_move")],
)
def test_disable_adapter_reference_passes_during_training_match_plain(size, order):
    """DPO-style: the frozen model's outputs by ``disable_adapter()`` before the step's forward
    (no grad) and inside it (with grad, one graph with the adapted forward)."""
    base, data = tiny_llama(size), batches(5)
    runs = []
    for kind in ("plain", order):
        model = wrap(copy.deepcopy(base), lora(use_dora=True), kind, size)
        optimizer = adamw(model)
        losses = []
        for ids in data:
            with torch.no_grad(), model.disable_adapter():
                before = model(input_ids=ids).logits.log_softmax(-1)
            adapted = model(input_ids=ids).logits.log_softmax(-1)
            with model.disable_adapter():
                inside = model(input_ids=ids).logits.log_softmax(-1)
            reference = (adapted - before).pow(2).mean() + (adapted - inside).pow(2).mean()
            losses.append(_step(model, optimizer, ids, reference))
        runs.append(Run(losses, _lora_weights(model)))
    assert_same_training(*runs)


@pytest.mark.parametrize("variant", [{}, {"use_dora": True}], ids=["lora", "dora"])
@pytest.mark.parametrize("size", ["resident", "chunked"])
def test_merge_and_unmerge_between_steps_then_training_on_matches_plain(variant, size):
    """``merge_adapter()`` for an evaluation mid-run, ``unmerge_adapter()``, more steps: the
    base weights written twice stay in the offloaded chunks."""
    base, data = tiny_llama(size), batches(8)
    runs = []
    for kind in ("plain", "peft_then_move"):
        model = wrap(copy.deepcopy(base), lora(**variant), kind, size)
        optimizer = adamw(model)
        losses = [_step(model, optimizer, ids) for ids in data[:4]]
        model.merge_adapter()
        with torch.no_grad():
            losses.append(model(input_ids=data[0], labels=data[0]).loss.item())
        model.unmerge_adapter()
        losses += [_step(model, optimizer, ids) for ids in data[4:]]
        runs.append(Run(losses, _lora_weights(model)))
    assert_same_training(*runs)


@pytest.mark.parametrize("order", ["peft_then_move", "move_then_peft"])
def test_prepare_model_for_kbit_training_on_an_unquantized_model_matches_plain(order):
    """Called on an fp32 model (no bitsandbytes), before or after the base attached."""
    base, data = tiny_llama(), batches(5)
    runs = []
    for kind in ("plain", order):
        model = copy.deepcopy(base)
        if kind != "plain":
            enable_cpu()
        if kind == "move_then_peft":
            model.to("cpu")
        model = prepare_model_for_kbit_training(model)
        torch.manual_seed(123)
        peft_model = get_peft_model(model, lora())
        peft_model.to("cpu")
        assert (runtime_for(peft_model) is not None) == (kind != "plain")
        runs.append(Run(train(peft_model, data), _lora_weights(peft_model)))
    assert_same_training(*runs)


@pytest.mark.parametrize("size", ["resident", "chunked"])
def test_trainable_parameter_counts_equal_plain(size, capsys):
    """``get_nb_trainable_parameters`` and ``print_trainable_parameters`` count offloaded params
    at their real sizes."""

    def add_second(model):
        torch.manual_seed(7)
        model.add_adapter("second", lora(r=4))

    reports = []
    for order in ("plain", "peft_then_move", "move_then_peft"):
        config = lora(modules_to_save=["lm_head"])
        model = wrap(tiny_llama(size, tied=True), config, order, size, before_move=add_second)
        counts = model.get_nb_trainable_parameters()
        model.print_trainable_parameters()
        reports.append((counts, capsys.readouterr().out))
        autooffload.disable()
    assert reports[0][0][0] > 0
    assert reports[1] == reports[0]
    assert reports[2] == reports[0]


@pytest.mark.parametrize("size", ["resident", "chunked"])
@pytest.mark.parametrize("saved", [["lm_head"], ["embed_tokens", "lm_head"]], ids=["head", "both"])
def test_modules_to_save_with_tied_embeddings_matches_plain(saved, size):
    """The trainable copies of a head tied to the embedding (and of the embedding) untie them:
    each copy trains on its own while the frozen original stays shared and offloaded."""
    base, data = tiny_llama(size, tied=True), batches(6)
    config = lora(modules_to_save=saved)
    order = "move_then_peft" if size == "resident" else "peft_then_move"
    assert_same_training(
        run(base, config, "plain", size, data), run(base, config, order, size, data)
    )
