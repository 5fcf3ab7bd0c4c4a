"""QLoRA (bitsandbytes 4-bit base, PEFT LoRA adapters) with every base chunk offloaded.

CPU simulation, fp32 compute: the quantized weights and every quant-state tensor travel in
their chunk (freed with it while it lives on the host), training equals plain PEFT training on
the same quantized model, ``disable()`` gives back every quantized byte unchanged, the state
dict (bitsandbytes' quant-state keys included) equals the plain one, and the layout counts the
real bytes. The GPU versions (bf16, 8-bit optimizers) are in ``tests/gpu/test_qlora_gpu.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import PeftModel, get_peft_model, prepare_model_for_kbit_training

import autooffload
from autooffload.errors import AttachError
from autooffload.runtime.chunks.layout import ALIGN
from autooffload.runtime.chunks.store import Residency
from tests.peft.peft_runs import (
    ATOL,
    RTOL,
    Run,
    assert_same_training,
    batches,
    enable_cpu,
    lora,
    runtime_for,
    tiny_llama,
    train,
    trained_weights,
)
from tests.peft.qlora_runs import (
    QUANT_KINDS,
    assert_bit_identical,
    bnb,
    int8_model,
    quant_tensors,
    quantize_linears,
    quantized_bytes,
)

STEPS = 20
# A quantized decoder layer (hidden 256) is ~110 KB: it spans several chunks.
CHUNK_SIZE = 40_000
# q_proj/v_proj adapters are ~6% of the bytes: resident, trained by the user's optimizer.
# All-linear adapters are ~25%: chunked with the frozen 4-bit base, trained by the CPU twin.
TARGETS = {"resident": ["q_proj", "v_proj"], "chunked": "all-linear"}


def qlora_model(kind: str = "nf4-double") -> torch.nn.Module:
    return quantize_linears(tiny_llama("resident"), **QUANT_KINDS[kind])


def wrap(
    base: torch.nn.Module, targets: str, attached: bool, n_persist: int = 0, **kbit
) -> PeftModel:
    """What a QLoRA script does: prepare for k-bit training, get_peft_model, move (attached
    with the first ``n_persist`` chunks persistent)."""
    model = prepare_model_for_kbit_training(copy.deepcopy(base), **kbit)
    torch.manual_seed(123)
    model = get_peft_model(model, lora(target_modules=TARGETS[targets]))
    if attached:
        enable_cpu(chunk_size=CHUNK_SIZE, n_persist=n_persist)
        model.to("cpu")
        assert runtime_for(model) is not None, "the model is not attached"
    return model


@pytest.mark.parametrize("targets", list(TARGETS))
@pytest.mark.parametrize("kind", list(QUANT_KINDS))
def test_qlora_training_attached_matches_plain(kind, targets):
    base, data = qlora_model(kind), batches(STEPS)
    original = quant_tensors(base)
    plain = wrap(base, targets, attached=False)
    expected = Run(train(plain, data), trained_weights(plain))

    model = wrap(base, targets, attached=True)
    runtime = runtime_for(model)
    assert (runtime.resident_params != []) == (targets == "resident")
    losses = train(model, data)
    quantized = [p for p in model.parameters() if isinstance(p, bnb.nn.Params4bit)]
    assert quantized and all(runtime.is_offloaded(p) for p in quantized)
    # absmax and code, with double quantization also offset and the nested absmax and code.
    per_weight = [runtime.quantized.of(p) for p in quantized]
    assert all(len(c) in (2, 5) for c in per_weight), "quant state not chunked"
    chunked = all(runtime.owns(t) for c in per_weight for t in c)
    assert chunked, "a quant-state tensor is outside the chunks"
    # Frozen quantized weights are never trained: no gradient, no CPU optimizer bookkeeping.
    assert all(p.grad is None and id(p) not in runtime.cpu_optim.masters for p in quantized)
    if targets == "resident":
        assert runtime.stats()["d2h_bytes"] == 0, "a frozen chunk sent gradients to the host"
    autooffload.disable()

    assert_same_training(expected, Run(losses, trained_weights(model)))
    assert_bit_identical(original, quant_tensors(model))
    lora_b = [w for n, w in expected.adapters.items() if "lora_B" in n]
    assert lora_b and all(w.abs().max() > 1e-3 for w in lora_b), "the adapters did not train"


def test_qlora_with_kbit_preparation_and_gradient_checkpointing_matches_plain():
    """``prepare_model_for_kbit_training`` with HF gradient checkpointing and input grads on,
    as QLoRA scripts call it: the runtime takes the checkpointing over, results unchanged."""
    base, data = qlora_model(), batches(STEPS)
    kbit = {"use_gradient_checkpointing": True}
    plain = wrap(base, "resident", attached=False, **kbit)
    expected = Run(train(plain, data), trained_weights(plain))
    model = wrap(base, "resident", attached=True, **kbit)
    model.enable_input_require_grads()
    assert runtime_for(model).activations.hf_checkpointing_taken
    losses = train(model, data)
    autooffload.disable()
    assert_same_training(expected, Run(losses, trained_weights(model)))


def test_quant_state_moves_with_its_chunk_and_sizes_count_real_bytes():
    base = qlora_model()
    model = wrap(base, "resident", attached=True)
    runtime = runtime_for(model)
    manager, layout = runtime.manager, runtime.layout
    slot_of = layout.slot_of()
    weights = [p for p in model.parameters() if isinstance(p, bnb.nn.Params4bit)]
    for weight in weights:
        companions = runtime.quantized.of(weight)
        state = weight.quant_state
        expected = [state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code]
        assert {id(t) for t in companions} == {id(t) for t in expected}
        chunk = slot_of[id(weight)][0]
        assert all(slot_of[id(t)][0] is chunk for t in companions), "companion in another chunk"
        # Offloaded: the device storage of the weight and of its whole quant state is freed.
        assert manager.state[chunk.index] == Residency.HOST
        assert all(t.untyped_storage().nbytes() == 0 for t in [weight, *companions])
    # bitsandbytes' cached code table is not chunked (each state has a private copy): a later
    # quantization still reads it while every chunk is on the host.
    cache = bnb.functional.name2qmap["dynamic"]
    assert all(cache is not slot.param for c in layout.chunks for slot in c.slots)
    torch.testing.assert_close(cache, bnb.functional.create_dynamic_map())

    chunked = [s for c in layout.chunks for s in c.slots]
    real = {id(s.param): s.param.numel() * s.param.element_size() for s in chunked}
    assert all(s.nbytes == real[id(s.param)] for s in chunked)
    quant_slots = [s for s in chunked if not s.dtype.is_floating_point or "quant_state" in s.name]
    assert sum(s.nbytes for s in quant_slots) == quantized_bytes(base)
    padded = sum((n + ALIGN - 1) // ALIGN * ALIGN for n in real.values())
    assert layout.total_bytes == padded == manager.host.total_bytes
    assert runtime.plan.n_chunks == len(layout.chunks)


@pytest.mark.parametrize("n_persist", [0, 4])
def test_state_dict_of_attached_qlora_equals_plain(n_persist):
    base, data = qlora_model(), batches(2)
    plain = wrap(base, "resident", attached=False)
    train(plain, data)
    model = wrap(base, "resident", attached=True, n_persist=n_persist)
    train(model, data)
    expected, actual = plain.state_dict(), model.state_dict()
    assert any(k.endswith("weight.nested_absmax") for k in actual)
    assert any("bitsandbytes__nf4" in k for k in actual)
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        if "lora_" in key:
            torch.testing.assert_close(actual[key], value, rtol=RTOL, atol=ATOL, msg=key)
        else:
            assert torch.equal(actual[key], value), key
    assert all(v.untyped_storage().nbytes() > 0 for v in actual.values()), "a freed tensor"


def test_disable_restores_shared_code_tables():
    """On CUDA bitsandbytes gives every nested state one cached code table (``name2qmap``):
    while attached each layer has a private copy in its chunk, so releasing a chunk frees no
    table another layer (or bitsandbytes) reads; detach puts the shared table back."""
    model = qlora_model()  # no deepcopy: that would un-share the table
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    shared = layers[0].weight.quant_state.state2.code
    for layer in layers:
        layer.weight.quant_state.state2.code = shared  # as quantize_blockwise does on CUDA

    def tables() -> list[int]:
        return [id(m.weight.quant_state.state2.code) for m in layers]

    before = tables()
    enable_cpu(chunk_size=CHUNK_SIZE)
    model.to("cpu")
    assert len(set(tables())) == len(layers), "attached layers share a chunked code table"
    assert shared.untyped_storage().nbytes() > 0, "a release freed the shared table"
    autooffload.disable()
    assert tables() == before, "detach did not put bitsandbytes' shared code table back"


def test_int8_lora_attached_matches_plain():
    base, data = int8_model(), batches(4)
    original = {
        n: (m.weight.data.clone(), m.weight.SCB.clone())
        for n, m in base.named_modules()
        if isinstance(m, bnb.nn.Linear8bitLt)
    }
    plain = wrap(base, "resident", attached=False)
    expected = Run(train(plain, data), trained_weights(plain))
    model = wrap(base, "resident", attached=True)
    runtime = runtime_for(model)
    weights = [p for p in model.parameters() if p.dtype == torch.int8]
    assert weights and all(runtime.is_offloaded(p) for p in weights)
    losses = train(model, data)
    saved = model.state_dict()
    autooffload.disable()
    assert_same_training(expected, Run(losses, trained_weights(model)))
    plain_saved = plain.state_dict()
    assert saved.keys() == plain_saved.keys()
    assert all(torch.equal(saved[k], v) for k, v in plain_saved.items() if "lora_" not in k)
    for name, module in model.get_base_model().named_modules():
        if isinstance(module, bnb.nn.Linear8bitLt):
            data_, scb = original[name.replace(".base_layer", "")]
            assert torch.equal(module.weight.data, data_)
            assert torch.equal(module.state.SCB, scb)
            assert module.state.CB.data_ptr() == module.weight.data_ptr()


def train_with(model: torch.nn.Module, optimizer_cls: type, data: list) -> list[float]:
    optimizer = optimizer_cls([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_bnb_8bit_optimizer_trains_resident_adapters_like_plain():
    """A bitsandbytes optimizer as the user's optimizer: resident adapters stay its own
    (it runs on the CPU here too); the attached run equals the plain one."""
    base, data = qlora_model(), batches(STEPS)
    plain = wrap(base, "resident", attached=False)
    expected = Run(train_with(plain, bnb.optim.AdamW8bit, data), trained_weights(plain))
    model = wrap(base, "resident", attached=True)
    losses = train_with(model, bnb.optim.AdamW8bit, data)
    autooffload.disable()
    assert_same_training(expected, Run(losses, trained_weights(model)))


def test_bnb_optimizer_over_offloaded_adapters_is_a_clear_error():
    """Adapters chunked with the base (over a tenth of the bytes) need a CPU twin, which a
    bitsandbytes optimizer has not: refused with a message that says what to use."""
    model = wrap(qlora_model(), "chunked", attached=True)
    params = [p for p in model.parameters() if p.requires_grad]
    with pytest.raises(AttachError, match="bitsandbytes optimizers update only params"):
        bnb.optim.AdamW8bit(params, lr=1e-2)


def test_qlora_with_base_attached_before_get_peft_model_matches_plain():
    """Order 2: the quantized base attaches, then PEFT wraps it (its bnb LoRA layers are created
    around chunked Linear4bit layers)."""
    base, data = qlora_model(), batches(STEPS)
    plain = wrap(base, "resident", attached=False)
    expected = Run(train(plain, data), trained_weights(plain))
    model = prepare_model_for_kbit_training(copy.deepcopy(base), use_gradient_checkpointing=False)
    enable_cpu(chunk_size=CHUNK_SIZE)
    model.to("cpu")
    torch.manual_seed(123)
    model = get_peft_model(model, lora(target_modules=TARGETS["resident"]))
    model.to("cpu")
    assert runtime_for(model) is not None
    losses = train(model, data)
    autooffload.disable()
    assert_same_training(expected, Run(losses, trained_weights(model)))


def test_merging_into_an_attached_quantized_base_is_refused():
    model = wrap(qlora_model(), "resident", attached=True)
    with pytest.raises(AttachError, match="disable"):
        model.merge_adapter()
    autooffload.disable()
    model.merge_adapter()  # detached: PEFT's own merge
