"""torch patches: ``.to()`` attaches, ``zero_grad`` and ``clip_grad_norm_`` see host gradients.

Runs in the CPU simulation (``device="cpu"``): a move to ``cpu`` is the move that attaches.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
import torch.nn.utils.clip_grad
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import autooffload
from autooffload import runtime as rt
from autooffload.errors import AttachError

CHUNK_SIZE = 20_000


@pytest.fixture(autouse=True)
def _one_thread_and_disable():
    """Tiny kernels on one thread (fast and stable on shared CI); nothing left attached."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    autooffload.disable()
    torch.set_num_threads(threads)


def tiny_llama(tied: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config).train()


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def enable_cpu(**overrides) -> None:
    settings = {"device": "cpu", "chunk_size": CHUNK_SIZE, "mask": False, "log": "warning"}
    autooffload.enable(**{**settings, **overrides})


IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


def host_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every chunked param's current bytes (host copy or resident copy), without a forward."""
    runtime = rt.runtime_of(model)
    runtime.synchronize()
    weights = {}
    for chunk in runtime.layout.chunks:
        for slot in chunk.slots:
            if chunk.index in runtime.manager.persistent:
                weights[slot.name] = slot.param.detach().clone()
            else:
                weights[slot.name] = runtime.manager.host_view(slot, chunk).clone()
    return weights


# ---- attach on .to() ---------------------------------------------------------------------------


def test_move_attaches_at_the_threshold_and_not_below():
    small = tiny_llama()
    enable_cpu(attach_threshold=param_bytes(small) + 1)
    small.to("cpu")
    assert rt.runtime_of(small) is None

    large = tiny_llama()
    enable_cpu(attach_threshold=param_bytes(large))
    assert large.to("cpu") is large
    assert rt.runtime_of(large) is not None


def test_force_attach_attaches_a_model_under_the_threshold():
    model = tiny_llama()
    enable_cpu(force_attach=True)  # the default threshold is 1 GiB
    model.to("cpu")
    assert rt.runtime_of(model) is not None


def test_offload_off_never_attaches():
    model = tiny_llama()
    enable_cpu(force_attach=True, offload=False)
    model.to("cpu")
    assert rt.runtime_of(model) is None


@pytest.mark.parametrize("offload_frozen", [False, None])
def test_model_without_trainable_params_attaches_only_as_offload_frozen_says(offload_frozen):
    model = tiny_llama().requires_grad_(False)
    enable_cpu(force_attach=True, offload_frozen=offload_frozen)
    model.to("cpu")
    if offload_frozen is False:
        assert rt.runtime_of(model) is None
        assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    else:  # auto: with force_attach whatever its size (tests/runtime/test_frozen_models.py)
        assert rt.runtime_of(model) is not None
        assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())


def test_moving_an_attached_model_to_its_device_again_changes_nothing():
    model = tiny_llama()
    enable_cpu(force_attach=True, n_persist=0)
    model.to("cpu")
    runtime = rt.runtime_of(model)
    assert model.to("cpu") is model
    assert rt.runtime_of(model) is runtime
    assert model(input_ids=IDS, labels=IDS).loss.isfinite()


@pytest.mark.parametrize(
    "convert",
    [lambda m: m.to(torch.bfloat16), lambda m: m.to("cpu", torch.float64)],
    ids=["to_bf16", "to_cpu_f64"],
)
def test_changing_the_dtype_of_an_attached_model_raises_and_names_the_fix(convert):
    model = tiny_llama()
    expected = copy.deepcopy(model)(input_ids=IDS).logits
    enable_cpu(force_attach=True, n_persist=0)
    model.to("cpu")
    with pytest.raises(AttachError, match=r"convert the model before moving it"):
        convert(model)
    # Refused before anything changed: the model still runs, in fp32, with its weights.
    assert all(p.dtype == torch.float32 for p in model.parameters())
    torch.testing.assert_close(model(input_ids=IDS).logits, expected)


def test_bfloat16_method_on_an_attached_model_raises_attach_error():
    model = tiny_llama()
    enable_cpu(force_attach=True, n_persist=0)
    model.to("cpu")
    with pytest.raises(AttachError):
        model.bfloat16()


def test_state_dict_of_an_attached_model_holds_the_weights():
    """Checkpointing mid-training (``torch.save(model.state_dict())``, HF Trainer's save_steps)."""
    model = tiny_llama()
    enable_cpu(force_attach=True, n_persist=0)
    model.to("cpu")
    state = model.state_dict()
    # Only storage sizes are read here: reading the tensors' data would crash the process.
    for name, tensor in state.items():
        assert tensor.untyped_storage().nbytes() >= tensor.numel() * tensor.element_size(), name


def test_printing_an_offloaded_parameter_shows_its_values_and_leaves_it_offloaded():
    """``print(model.layer.weight)`` while debugging: the placeholder has no bytes, so a plain
    repr would read out of bounds (a RuntimeError, or a crash); the patched one gathers."""
    model = tiny_llama()
    expected = repr(model.model.layers[1].mlp.down_proj.weight)
    enable_cpu(force_attach=True, n_persist=0)
    model.to("cpu")
    runtime = rt.runtime_of(model)
    weight = model.model.layers[1].mlp.down_proj.weight
    assert runtime.is_offloaded(weight) and weight.untyped_storage().nbytes() == 0
    assert repr(weight) == expected
    assert weight.untyped_storage().nbytes() == 0, "the print left the chunk on the device"
    assert runtime.manager.n_in_use() == 0


def _train_two_steps(model: nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for _ in range(2):
        model(input_ids=IDS, labels=IDS).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


def test_parameters_to_vector_and_back_see_the_offloaded_weights():
    plain = tiny_llama()
    attached = copy.deepcopy(plain)
    _train_two_steps(plain)
    enable_cpu(force_attach=True, n_persist=1)
    attached.to("cpu")
    _train_two_steps(attached)
    runtime = rt.runtime_of(attached)
    expected = torch.nn.utils.parameters_to_vector(plain.parameters())
    vector = torch.nn.utils.parameters_to_vector(attached.parameters())
    torch.testing.assert_close(vector, expected, rtol=0, atol=0)
    assert runtime.manager.n_in_use() == 0, "reading left chunks on the device"
    torch.nn.utils.vector_to_parameters(-vector, attached.parameters())
    state = attached.state_dict()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(state[name], -value, rtol=0, atol=0, msg=name)


def test_an_averaged_model_of_an_attached_model_averages_its_weights():
    """An EMA kept with ``torch.optim.swa_utils.AveragedModel`` (built before the attach)."""
    plain = tiny_llama()
    attached = copy.deepcopy(plain)
    averages = []
    for model in (plain, attached):
        ema_fn = torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
        averaged = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=ema_fn)
        if model is attached:
            enable_cpu(force_attach=True, n_persist=1)
            model.to("cpu")
            assert rt.runtime_of(model) is not None
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        for _ in range(3):
            model(input_ids=IDS, labels=IDS).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            averaged.update_parameters(model)
        averages.append(averaged.module.state_dict())
    assert averages[1].keys() == averages[0].keys()
    for name, value in averages[0].items():
        torch.testing.assert_close(averages[1][name], value, rtol=0, atol=0, msg=name)


# ---- zero_grad ----------------------------------------------------------------------------------


@pytest.mark.parametrize("who", ["model", "optimizer"])
def test_zero_grad_then_step_without_backward_leaves_offloaded_weights_alone(who):
    """torch skips params whose grad is None; cleared host grads must be skipped the same way."""
    model = tiny_llama()
    enable_cpu(force_attach=True, n_persist=1)
    model.to("cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model(input_ids=IDS, labels=IDS).loss.backward()
    optimizer.step()
    model(input_ids=IDS, labels=IDS).loss.backward()
    (model if who == "model" else optimizer).zero_grad()
    runtime = rt.runtime_of(model)
    runtime.synchronize()
    assert runtime.host_grads() == []
    before = host_weights(model)
    optimizer.step()
    after = host_weights(model)
    assert before.keys() == after.keys()
    for name, weight in before.items():
        assert torch.equal(after[name], weight), f"{name} moved on a step without gradients"


def test_zero_grad_keeping_tensors_zeroes_the_host_grads():
    model = tiny_llama()
    enable_cpu(force_attach=True, n_persist=0)
    model.to("cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(input_ids=IDS, labels=IDS).loss.backward()
    runtime = rt.runtime_of(model)
    grads = runtime.host_grads()
    assert grads and any(g.abs().sum() > 0 for g in grads)
    optimizer.zero_grad(set_to_none=False)
    kept = runtime.host_grads()
    assert len(kept) == len(grads)
    assert all(torch.count_nonzero(g) == 0 for g in kept)


def test_adagrad_built_after_attach_starts_offloaded_params_from_its_initial_accumulator():
    """Adagrad fills its sums in its own ``__init__``, after the base ``__init__`` bound it: the
    offloaded params' sums move to the CPU twins (which would start from 0), and the user's
    optimizer keeps none of them."""
    base = tiny_llama()
    plain, attached = copy.deepcopy(base), copy.deepcopy(base)
    enable_cpu(force_attach=True, n_persist=1)
    attached.to("cpu")
    runtime = rt.runtime_of(attached)
    losses = {}
    for name, model in (("plain", plain), ("attached", attached)):
        optimizer = torch.optim.Adagrad(model.parameters(), lr=1e-2, initial_accumulator_value=1.0)
        if model is attached:
            offloaded = [p for p in model.parameters() if runtime.is_offloaded(p)]
            assert offloaded and not any(p in optimizer.state for p in offloaded)
        losses[name] = []
        for _ in range(3):
            loss = model(input_ids=IDS, labels=IDS).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[name].append(loss.item())
    runtime.synchronize()
    assert losses["attached"] == pytest.approx(losses["plain"], rel=1e-6)
    expected = plain.state_dict()
    for name, value in attached.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=1e-6, atol=1e-7, msg=name)


# ---- clip_grad_norm_ ----------------------------------------------------------------------------


def _one_backward(model: nn.Module, attach: bool, n_persist: int = 1) -> None:
    if attach:
        enable_cpu(force_attach=True, n_persist=n_persist)
        model.to("cpu")
        assert rt.runtime_of(model) is not None
    model(input_ids=IDS, labels=IDS).loss.backward()


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("n_persist", [0, 2])
def test_clip_grad_norm_covers_host_grads_and_scales_them(norm_type, n_persist):
    base = tiny_llama()
    plain, attached = copy.deepcopy(base), copy.deepcopy(base)
    _one_backward(plain, attach=False)
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1, norm_type=norm_type)
    clipped = {n: p.grad for n, p in plain.named_parameters()}

    _one_backward(attached, attach=True, n_persist=n_persist)
    total = torch.nn.utils.clip_grad_norm_(attached.parameters(), 0.1, norm_type=norm_type)
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    assert expected > 0.1, "nothing was clipped; the test needs a smaller max_norm"
    runtime = rt.runtime_of(attached)
    runtime.synchronize()
    runtime.cpu_optim.grad_norms.host_grads()  # clipping of host grads is lazy; this applies it
    host_grads = {pid: master.grad for pid, master in runtime.cpu_optim.masters.items()}
    from_host = 0
    for name, param in attached.named_parameters():
        grad = param.grad if param.grad is not None else host_grads.get(id(param))
        assert grad is not None, name
        torch.testing.assert_close(grad, clipped[name], rtol=1e-5, atol=1e-8, msg=name)
        from_host += param.grad is None
    assert from_host > 0, "no host gradient was compared"


def test_clip_grad_norm_through_the_clip_grad_module_is_patched_too():
    base = tiny_llama()
    plain, attached = copy.deepcopy(base), copy.deepcopy(base)
    _one_backward(plain, attach=False)
    expected = torch.nn.utils.clip_grad.clip_grad_norm_(plain.parameters(), 1.0)
    _one_backward(attached, attach=True, n_persist=0)
    total = torch.nn.utils.clip_grad.clip_grad_norm_(attached.parameters(), 1.0)
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)


def test_clip_grad_norm_of_a_subset_only_sees_that_subset():
    base = tiny_llama()
    plain, attached = copy.deepcopy(base), copy.deepcopy(base)
    _one_backward(plain, attach=False)
    expected = torch.nn.utils.clip_grad_norm_(plain.model.layers[1].parameters(), 0.01)
    _one_backward(attached, attach=True, n_persist=0)
    total = torch.nn.utils.clip_grad_norm_(attached.model.layers[1].parameters(), 0.01)
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)


# ---- disable ------------------------------------------------------------------------------------


def test_disable_restores_every_patched_torch_entry_point():
    originals = {
        "Module.to": nn.Module.__dict__["to"],
        "Module.cuda": nn.Module.__dict__["cuda"],
        "Module.zero_grad": nn.Module.__dict__["zero_grad"],
        "Parameter.__repr__": nn.Parameter.__dict__["__repr__"],
        "torch.compile": torch.__dict__["compile"],
        "Module.compile": nn.Module.__dict__["compile"],
        "Optimizer.__init__": torch.optim.Optimizer.__dict__["__init__"],
        "Adagrad.__init__": torch.optim.Adagrad.__dict__["__init__"],
        "Optimizer.zero_grad": torch.optim.Optimizer.__dict__["zero_grad"],
        "Optimizer._optimizer_step_code": torch.optim.Optimizer.__dict__["_optimizer_step_code"],
        "utils.clip_grad_norm_": torch.nn.utils.clip_grad_norm_,
        "clip_grad.clip_grad_norm_": torch.nn.utils.clip_grad.clip_grad_norm_,
    }
    optimizer_module = importlib.import_module("torch.optim.optimizer")
    pre_hooks = dict(optimizer_module._global_optimizer_pre_hooks)
    enable_cpu(force_attach=True)
    assert nn.Module.__dict__["to"] is not originals["Module.to"]
    assert len(optimizer_module._global_optimizer_pre_hooks) == len(pre_hooks) + 1
    step_code = torch.optim.Optimizer.__dict__["_optimizer_step_code"]
    assert step_code is not originals["Optimizer._optimizer_step_code"]
    assert torch.nn.utils.clip_grad_norm_ is not originals["utils.clip_grad_norm_"]
    assert torch.__dict__["compile"] is not originals["torch.compile"]
    autooffload.disable()
    restored = {
        "Module.to": nn.Module.__dict__["to"],
        "Module.cuda": nn.Module.__dict__["cuda"],
        "Module.zero_grad": nn.Module.__dict__["zero_grad"],
        "Parameter.__repr__": nn.Parameter.__dict__["__repr__"],
        "torch.compile": torch.__dict__["compile"],
        "Module.compile": nn.Module.__dict__["compile"],
        "Optimizer.__init__": torch.optim.Optimizer.__dict__["__init__"],
        "Adagrad.__init__": torch.optim.Adagrad.__dict__["__init__"],
        "Optimizer.zero_grad": torch.optim.Optimizer.__dict__["zero_grad"],
        "Optimizer._optimizer_step_code": torch.optim.Optimizer.__dict__["_optimizer_step_code"],
        "utils.clip_grad_norm_": torch.nn.utils.clip_grad_norm_,
        "clip_grad.clip_grad_norm_": torch.nn.utils.clip_grad.clip_grad_norm_,
    }
    for name, original in originals.items():
        assert restored[name] is original, f"{name} was not restored"
    assert dict(optimizer_module._global_optimizer_pre_hooks) == pre_hooks
    model = tiny_llama()
    model.to("cpu")
    assert rt.runtime_of(model) is None


def test_ddp_over_a_model_attached_with_data_parallel_off_under_several_ranks_raises(
    monkeypatch: pytest.MonkeyPatch,
):
    """Several ranks and ``data_parallel=off``: DDP would reduce and broadcast offloaded params
    (no device storage between uses); the wrap raises, naming the setting and its fix."""
    enable_cpu(force_attach=True, data_parallel="off")
    model = tiny_llama().to("cpu")
    assert rt.runtime_of(model).data_parallel is None
    monkeypatch.setattr("autooffload.runtime.parallel.distributed.world", lambda: (0, 2))
    with pytest.raises(AttachError, match="AUTOOFFLOAD_DATA_PARALLEL=auto"):
        nn.parallel.DistributedDataParallel(model)


@pytest.mark.parametrize("how", ["torch.compile", "Module.compile"])
def test_compiling_an_attached_model_raises_a_clear_error(how: str):
    """Dynamo cannot trace the offload hooks; without the check the first forward failed deep in
    torch.utils.checkpoint with an assertion about ``context_fn``."""
    enable_cpu(force_attach=True)
    model = tiny_llama().to("cpu")
    assert rt.runtime_of(model) is not None
    with pytest.raises(AttachError, match="torch.compile.*AUTOOFFLOAD_OFFLOAD=0"):
        if how == "torch.compile":
            torch.compile(model)
        else:
            model.compile()
    with pytest.raises(AttachError, match="torch.compile"):
        torch.compile(model.model.layers[0])  # a managed submodule
    assert callable(torch.compile(lambda x: x + 1))  # functions are not affected


@pytest.mark.parametrize("how", ["torch.compile", "Module.compile"])
def test_moving_a_compiled_model_to_the_device_refuses_to_attach(how: str):
    enable_cpu(force_attach=True)
    model = tiny_llama()
    if how == "torch.compile":
        model = torch.compile(model)
    else:
        model.compile()
    with pytest.raises(AttachError, match="torch.compile"):
        model.to("cpu")
    assert not rt.runtimes()


@pytest.mark.parametrize(
    "convert",
    [
        lambda m: m.to(torch.float32),
        lambda m: m.to("cpu", torch.float32),
        lambda m: m.to(device="cpu", dtype=torch.float32),
        lambda m: m.float(),
    ],
    ids=["to_f32", "to_cpu_f32", "to_kwargs", "float"],
)
def test_converting_an_attached_model_to_its_own_dtype_changes_nothing(convert):
    model = tiny_llama()
    expected = copy.deepcopy(model)(input_ids=IDS).logits
    enable_cpu(force_attach=True, n_persist=0)
    model.to("cpu")
    runtime = rt.runtime_of(model)
    assert convert(model) is model
    assert rt.runtime_of(model) is runtime
    torch.testing.assert_close(model(input_ids=IDS).logits, expected)


@pytest.mark.parametrize(
    "convert",
    [
        lambda m: m.to(torch.bfloat16),
        lambda m: m.half(),
        lambda m: m["model"].model.to(torch.float64),
    ],
    ids=["wrapper_to_bf16", "wrapper_half", "submodule_to_f64"],
)
def test_changing_the_dtype_around_or_inside_an_attached_model_raises(convert):
    model = tiny_llama()
    expected = copy.deepcopy(model)(input_ids=IDS).logits
    enable_cpu(force_attach=True, n_persist=0)
    box = nn.ModuleDict({"model": model, "head": nn.Linear(4, 4)})
    model.to("cpu")
    with pytest.raises(AttachError, match=r"convert the model before moving it"):
        convert(box)
    assert all(p.dtype == torch.float32 for p in box.parameters())
    torch.testing.assert_close(model(input_ids=IDS).logits, expected)


def test_converting_a_wrapper_to_its_attached_models_dtype_converts_only_the_rest():
    model = tiny_llama()
    enable_cpu(force_attach=True, n_persist=0)
    box = nn.ModuleDict({"model": model, "head": nn.Linear(4, 4).double()})
    model.to("cpu")
    assert box.to(torch.float32) is box
    assert box["head"].weight.dtype == torch.float32
    assert model(input_ids=IDS, labels=IDS).loss.isfinite()
