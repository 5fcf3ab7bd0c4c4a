"""PEFT tuners other than LoRA on an attached model: trainable tokens (``trainable_token_indices``,
which reads the base embedding without calling its forward), IA3, LoHa, LoKr, VeRA, OFT and
AdaLoRA (with adapters on the device; with adapters in chunks it is refused) train like plain
PEFT, and ``merge_and_unload()`` (which reads and writes base weights outside any block) gives
plain's merged model, attached and after detach."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from peft import (
    AdaLoraConfig,
    IA3Config,
    LoHaConfig,
    LoKrConfig,
    OFTConfig,
    PeftConfig,
    PrefixTuningConfig,
    TaskType,
    VeraConfig,
    get_peft_model,
)

import autooffload
from autooffload.errors import AttachError, PlanError
from tests.peft.peft_runs import (
    Run,
    adamw,
    assert_same_training,
    batches,
    enable_cpu,
    lora,
    runtime_for,
    tiny_llama,
    train,
    trained_weights,
    wrap,
)
from tests.peft.test_peft_paths import MERGE_ATOL, MERGE_RTOL

STEPS = 4
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TUNERS: dict[str, Callable[[], PeftConfig]] = {
    "trainable_tokens": lambda: lora(trainable_token_indices=[1, 2, 3]),
    "ia3": lambda: IA3Config(
        target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]
    ),
    "loha": lambda: LoHaConfig(r=4, target_modules=[*LINEAR, "lm_head"]),
    "lokr": lambda: LoKrConfig(r=4, target_modules=LINEAR),
    "vera": lambda: VeraConfig(r=8, target_modules=["q_proj", "v_proj"]),
    "oft": lambda: OFTConfig(r=0, oft_block_size=8, target_modules=["q_proj", "v_proj"]),
}


def _train_and_merge(
    base: torch.nn.Module, config: PeftConfig, order: str, size: str, data: list[torch.Tensor]
) -> tuple[Run, list[torch.Tensor]]:
    model = wrap(copy.deepcopy(base), config, order, size)
    losses = train(model, data)
    with torch.no_grad():
        unmerged = model(input_ids=data[0]).logits.clone()
        merged_model = model.merge_and_unload()
        merged = merged_model(input_ids=data[0]).logits.clone()
        autooffload.disable()
        weights = trained_weights(model)
        detached = merged_model(input_ids=data[0]).logits.clone()
    return Run(losses, weights), [unmerged, merged, detached]


@pytest.mark.parametrize(
    ("tuner", "order", "size"),
    [
        ("trainable_tokens", "peft_then_move", "resident"),
        ("trainable_tokens", "move_then_peft", "resident"),
        ("trainable_tokens", "peft_then_move", "chunked"),
        ("ia3", "peft_then_move", "resident"),
        ("ia3", "move_then_peft", "chunked"),
        ("loha", "peft_then_move", "resident"),
        ("lokr", "move_then_peft", "resident"),
        ("vera", "peft_then_move", "resident"),
        ("oft", "peft_then_move", "resident"),
    ],
)
def test_tuner_trains_and_merges_like_plain_peft(tuner, order, size):
    base, data = tiny_llama(size), batches(STEPS)
    plain, plain_logits = _train_and_merge(base, TUNERS[tuner](), "plain", size, data)
    attached, logits = _train_and_merge(base, TUNERS[tuner](), order, size, data)
    assert_same_training(plain, attached)
    for name, expected, actual in zip(("unmerged", "merged", "detached"), plain_logits, logits):
        torch.testing.assert_close(actual, expected, rtol=MERGE_RTOL, atol=MERGE_ATOL, msg=name)


def test_prefix_tuning_needs_kept_activations_and_then_trains_like_plain():
    """Prefix tuning hands its trained prefix to every block as a filled KV cache: a checkpointed
    or swapped block cannot take it (a recompute appends to it again), and dropping it, as for
    an empty cache, would change the result. That is a clear error; with activations kept the
    run trains like plain PEFT."""

    def prefix_model(**settings) -> torch.nn.Module:
        base = tiny_llama()
        if settings:
            enable_cpu(**settings)
            base.to("cpu")
        torch.manual_seed(123)
        config = PrefixTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4)
        model = get_peft_model(base, config)
        if settings:
            model.to("cpu")
            assert runtime_for(model) is not None
        return model

    data = batches(STEPS)
    plain = prefix_model()
    expected = Run(train(plain, data), trained_weights(plain))

    with pytest.raises(PlanError, match="AUTOOFFLOAD_ACTIVATION_MODE=keep"):
        train(prefix_model(activation_mode="auto"), data)
    autooffload.disable()

    model = prefix_model(activation_mode="keep")
    losses = train(model, data)
    autooffload.disable()
    assert_same_training(expected, Run(losses, trained_weights(model)))


def _adalora(task_type: TaskType | None = TaskType.CAUSAL_LM) -> AdaLoraConfig:
    return AdaLoraConfig(
        task_type=task_type,
        init_r=8,
        target_r=4,
        tinit=1,
        tfinal=2,
        deltaT=1,
        total_step=STEPS + 2,
        target_modules=["q_proj", "v_proj", "down_proj"],
        lora_dropout=0.0,
    )


def _train_adalora(model: torch.nn.Module, data: list[torch.Tensor]) -> Run:
    """AdaLoRA's loop: ``update_and_allocate`` after each step reads the adapters' gradients
    and masks the least important ranks."""
    optimizer = adamw(model)
    losses = []
    for i, ids in enumerate(data):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        model.base_model.update_and_allocate(i)
        optimizer.zero_grad()
        losses.append(loss.item())
    autooffload.disable()
    return Run(losses, trained_weights(model))


def test_adalora_with_adapters_on_the_device_trains_like_plain():
    """Its orthogonal regularization reads every adapter after the model's forward."""
    base, data = tiny_llama(), batches(STEPS + 2)
    expected = _train_adalora(wrap(copy.deepcopy(base), _adalora(), "plain", "resident"), data)
    model = wrap(copy.deepcopy(base), _adalora(), "move_then_peft", "resident")
    assert_same_training(expected, _train_adalora(model, data))


@pytest.mark.parametrize("task_type", [TaskType.CAUSAL_LM, None], ids=["causal_lm", "no_task"])
def test_adalora_with_adapters_in_chunks_is_refused_before_a_step(task_type):
    """Adapters over a tenth of the bytes are offloaded in chunks: AdaLoRA would read them and
    their gradients outside the blocks. Refused at the first forward that runs AdaLoRA's own
    (with a task type), else at the first ``update_and_allocate``, before the step it adjusts."""
    model = wrap(tiny_llama("chunked"), _adalora(task_type), "peft_then_move", "chunked")
    ids = batches(1)[0]
    with pytest.raises(AttachError, match="AdaLoRA with adapters offloaded in chunks"):
        model(input_ids=ids, labels=ids).loss.backward()
        model.base_model.update_and_allocate(0)
