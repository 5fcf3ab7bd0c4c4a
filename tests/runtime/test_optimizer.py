"""The CPU optimizer twin: supported classes, fp32 master weights, the user's hyperparameters."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import autooffload
from autooffload import runtime as rt
from autooffload.errors import AttachError
from autooffload.runtime.update import grad_staging
from autooffload.runtime.update.twins import CPU_OPTIMIZERS

pytestmark = pytest.mark.usefixtures("one_thread")


class _SignDescent(torch.optim.Optimizer):
    """A user-written optimizer: autooffload has no CPU twin for it."""

    def __init__(self, params, lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad.sign(), alpha=-group["lr"])


class _MyAdamW(torch.optim.AdamW):
    """A subclass may change ``step``; the twin would silently run plain AdamW instead."""


@pytest.mark.parametrize("optimizer_class", [_SignDescent, _MyAdamW])
def test_unsupported_optimizer_over_offloaded_params_names_the_supported_ones(
    make_llama, offload_cpu, optimizer_class
):
    model = make_llama()
    offload_cpu(n_persist=1)
    model.to("cpu")
    with pytest.raises(AttachError) as error:
        optimizer_class(model.parameters(), lr=1e-3)
    message = str(error.value)
    assert optimizer_class.__name__ in message
    for name in CPU_OPTIMIZERS:
        assert name in message
    assert "AUTOOFFLOAD_N_PERSIST" in message or "AUTOOFFLOAD_OFFLOAD" in message


def _adafactor(params, lr: float) -> torch.optim.Optimizer:
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=lr, relative_step=False, scale_parameter=False)


@pytest.mark.parametrize(
    "build",
    [torch.optim.LBFGS, torch.optim.SparseAdam, _adafactor],
    ids=["LBFGS", "SparseAdam", "Adafactor"],
)
def test_other_optimizers_over_offloaded_params_are_refused_before_training(
    make_llama, offload_cpu, build
):
    """LBFGS (its closure re-evaluated within a step), SparseAdam and transformers' Adafactor
    have no CPU twin: refused when built, not at a step that would train wrongly."""
    model = make_llama(n_layers=2)
    offload_cpu(n_persist=0)
    model.to("cpu")
    with pytest.raises(AttachError, match="no CPU path for offloaded parameters"):
        build(model.parameters(), lr=1e-3)


class _SparseEmbeddingModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(128, 64, sparse=True)
        self.layers = nn.ModuleList([nn.Linear(64, 64) for _ in range(3)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden.sum()


def test_a_trainable_sparse_embedding_is_refused_at_attach(offload_cpu):
    model = _SparseEmbeddingModel()
    offload_cpu(n_persist=0)
    with pytest.raises(AttachError, match="embed is a trainable Embedding with sparse=True"):
        model.to("cpu")
    model.embed.weight.requires_grad_(False)
    model.to("cpu")
    assert rt.runtime_of(model) is not None


def test_reduce_lr_on_plateau_trains_like_plain(make_llama, offload_cpu):
    """The learning rate it lowers after a step reaches the offloaded params' next update."""
    plain = make_llama(n_layers=2)
    attached = copy.deepcopy(plain)
    losses = []
    for model in (plain, attached):
        if model is attached:
            offload_cpu(n_persist=1)
            model.to("cpu")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        # Every loss counts as no improvement: the rate halves after every step.
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, factor=0.5, patience=0, threshold=10.0
        )
        run = []
        for step in range(4):
            ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(step))
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            plateau.step(loss.item())
            run.append(loss.item())
        assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 / 16)
        losses.append((run, model.state_dict()))
    assert losses[1][0] == losses[0][0]
    for name, value in losses[0][1].items():
        torch.testing.assert_close(losses[1][1][name], value, rtol=0, atol=0, msg=name)


def test_unsupported_optimizer_is_fine_when_every_chunk_is_persistent(
    make_llama, offload_cpu, chunk_count
):
    """Nothing to update on the CPU: the user's optimizer does all the work itself."""
    model = make_llama()
    offload_cpu(n_persist=chunk_count(model))
    model.to("cpu")
    assert rt.runtime_of(model) is not None
    optimizer = _SignDescent(model.parameters(), lr=1e-2)
    before = model.lm_head.weight.detach().clone()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    assert not torch.equal(model.lm_head.weight, before)


@pytest.mark.parametrize("name", CPU_OPTIMIZERS)
def test_every_listed_optimizer_class_is_accepted(make_llama, offload_cpu, name):
    model = make_llama(n_layers=2)
    offload_cpu(n_persist=0)
    model.to("cpu")
    optimizer = getattr(torch.optim, name)(model.parameters(), lr=1e-3)
    runtime = rt.runtime_of(model)
    assert any(o is optimizer for o in runtime.optimizers)
    before = {
        s.name: runtime.manager.host_view(s, c).clone()
        for c in runtime.layout.chunks
        for s in c.slots
    }
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    runtime.synchronize()
    changed = [
        s.name
        for c in runtime.layout.chunks
        for s in c.slots
        if not torch.equal(runtime.manager.host_view(s, c), before[s.name])
    ]
    assert len(changed) == len(before), f"{name} left offloaded params untouched"
    # Detached, the same optimizer goes on with the state the CPU side kept (scalar states
    # such as NAdam's mu_product included).
    autooffload.disable()
    if name != "SGD":  # no state without momentum
        assert all(p in optimizer.state for p in model.parameters())
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()


class _Adders(nn.Module):
    """out = sum_i W_i @ x with x = 1: every weight's gradient of out.sum() is exactly 1."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4, bias=False) for _ in range(2)])
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.fill_(1.0)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(layer(x) for layer in self.layers)


def _train_adders(model: nn.Module, steps: int = 20) -> torch.Tensor:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.ones(1, 4, dtype=torch.bfloat16)
    for _ in range(steps):
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


def test_fp32_master_weights_keep_updates_smaller_than_bf16_spacing(offload_cpu):
    """20 SGD steps of 1e-3 from 1.0: bf16 alone rounds each back to 1.0 (its spacing there is
    2**-8); the fp32 master accumulates them to 0.98."""
    plain = _Adders(torch.bfloat16)
    _train_adders(plain)
    assert torch.equal(plain.layers[0].weight, torch.ones(4, 4, dtype=torch.bfloat16))

    model = _Adders(torch.bfloat16)
    offload_cpu(n_persist=0, master_weights=True, chunk_size=64)
    model.to("cpu")
    runtime = rt.runtime_of(model)
    _train_adders(model)
    runtime.synchronize()
    masters = list(runtime.cpu_optim.masters.values())
    assert len(masters) == 2 and all(m.dtype == torch.float32 for m in masters)
    torch.testing.assert_close(masters[0], torch.full((4, 4), 0.98), rtol=0, atol=1e-6)
    chunk = runtime.layout.chunks[0]
    host = runtime.manager.host_view(chunk.slots[0], chunk)
    assert torch.equal(host, torch.full((4, 4), 0.98).bfloat16())


def test_without_master_weights_bf16_training_matches_plain_bf16(offload_cpu):
    plain = _Adders(torch.bfloat16)
    _train_adders(plain)
    model = _Adders(torch.bfloat16)
    offload_cpu(n_persist=0, master_weights=False, chunk_size=64)
    model.to("cpu")
    runtime = rt.runtime_of(model)
    _train_adders(model)
    runtime.synchronize()
    assert all(m.dtype == torch.bfloat16 for m in runtime.cpu_optim.masters.values())
    for chunk in runtime.layout.chunks:
        for slot in chunk.slots:
            host = runtime.manager.host_view(slot, chunk)
            assert torch.equal(host, torch.ones(4, 4, dtype=torch.bfloat16))


def test_step_and_zero_grad_return_before_the_cpu_update_yet_the_next_forward_sees_it(
    make_llama, offload_cpu
):
    """The update is queued on the worker thread; each chunk's next gather waits for it.
    ``zero_grad()`` right after ``step()`` must not wait for it either: the next forward is what
    the update overlaps with."""
    model = make_llama(n_layers=2)
    # A fixed plan: the profiled steps of the auto plan wait for the CPU optimizer on purpose.
    offload_cpu(n_persist=0, activation_mode="keep")
    model.to("cpu")
    runtime = rt.runtime_of(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    gate = threading.Event()
    runtime.cpu_optim.worker.submit(gate.wait, 30)
    optimizer.step()
    optimizer.zero_grad()
    assert runtime.cpu_optim.updates == 0, "step() or zero_grad() waited for the CPU update"
    gate.set()
    model.eval()
    with torch.no_grad():
        after_step = model(input_ids=ids).logits
    runtime.synchronize()
    assert runtime.cpu_optim.updates == len(runtime.layout.chunks)
    with torch.no_grad():
        settled = model(input_ids=ids).logits
    assert torch.equal(after_step, settled), "the forward read weights the update had not written"


def _plain_and_attached(make_llama, offload_cpu):
    """Two equal tiny models, the second attached with every chunk offloaded; its runtime."""
    torch.manual_seed(0)
    plain = make_llama(n_layers=2)
    model = make_llama(n_layers=2)
    model.load_state_dict(plain.state_dict())
    offload_cpu(n_persist=0, activation_mode="keep")
    model.to("cpu")
    return plain, model, rt.runtime_of(model)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_queued_behind_the_update_keeps_training_equal_to_plain(
    make_llama, offload_cpu, set_to_none
):
    """zero_grad clears host gradients on the worker, after the pending update used them and
    before the next backward accumulates: three steps equal plain AdamW. The host gradients
    are the pinned staging itself (aliased)."""
    plain, model, runtime = _plain_and_attached(make_llama, offload_cpu)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, model)]
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        gate = threading.Event()
        runtime.cpu_optim.worker.submit(gate.wait, 30)  # the update is still queued at zero_grad
        for net, optimizer in zip((plain, model), optimizers, strict=True):
            net(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)
        gate.set()
    runtime.synchronize()
    trained = plain.state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, trained[name], rtol=1e-5, atol=1e-6, msg=name)


def _offloaded_grads(runtime) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(host gradient, its staging view) of every offloaded trainable param with a gradient."""
    optimizer, manager = runtime.cpu_optim, runtime.manager
    return [
        (optimizer.masters[id(slot.param)].grad, manager.grads.staging_view(slot, chunk))
        for chunk, slot in optimizer.offloaded_slots()
        if optimizer.masters[id(slot.param)].grad is not None
    ]


@pytest.mark.parametrize("master_weights", [False, True])
def test_host_gradients_are_the_staging_after_one_backward(make_llama, offload_cpu, master_weights):
    """The first backward's gradients are read where they landed (no copy pass) when the
    master has their dtype; fp32 masters of bf16 weights need the converting copy."""
    model = make_llama(n_layers=2).to(torch.bfloat16)
    offload_cpu(n_persist=0, activation_mode="keep", master_weights=master_weights)
    model.to("cpu")
    runtime = rt.runtime_of(model)
    torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    runtime.cpu_optim.wait()
    pairs = _offloaded_grads(runtime)
    assert pairs
    shared = [grad.data_ptr() == staged.data_ptr() for grad, staged in pairs]
    assert all(shared) if not master_weights else not any(shared)


@pytest.mark.parametrize("loop", ["no_zero_grad", "zero_grad_delayed"])
def test_gradients_aliased_to_the_staging_survive_its_next_write(make_llama, offload_cpu, loop):
    """The first backward's host gradients are the staging itself. ``no_zero_grad``: torch
    adds each backward's gradients to the last step's, so they are copied out before the next
    backward overwrites the staging. ``zero_grad_delayed``: ``zero_grad(set_to_none=False)``
    zeroes them on the worker; held up there (a gate released 0.2 s later), it must still run
    before the next backward writes new gradients into the staging, or it would wipe them."""
    plain, model, runtime = _plain_and_attached(make_llama, offload_cpu)
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in (plain, model)]
    batches = [
        torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(k)) for k in range(3)
    ]
    for ids in batches:
        for net, optimizer in zip((plain, model), optimizers, strict=True):
            net(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            if loop == "no_zero_grad":
                continue
            if net is model:
                gate = threading.Event()
                runtime.cpu_optim.worker.submit(gate.wait, 30)
                threading.Timer(0.2, gate.set).start()
            optimizer.zero_grad(set_to_none=False)
    runtime.synchronize()
    if loop == "no_zero_grad":
        assert not runtime.cpu_optim.staging.aliased, "gradients of later backwards stayed aliased"
        for grad, staged in _offloaded_grads(runtime):
            assert grad.data_ptr() != staged.data_ptr()
    trained = plain.state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, trained[name], rtol=1e-5, atol=1e-6, msg=name)


def test_cpu_updates_leave_the_launching_thread_a_core_on_a_gpu(monkeypatch):
    from autooffload.runtime.update.cpu_optimizer import update_threads

    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)
    assert update_threads(None, on_gpu=True) == 15
    assert update_threads(None, on_gpu=False) == 16  # CPU simulation: nothing to launch
    assert update_threads(4, on_gpu=True) == 4  # AUTOOFFLOAD_CPU_THREADS wins
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert update_threads(None, on_gpu=True) == 2  # too few cores to give one up


def test_the_worker_runs_with_the_cpu_threads_setting(make_llama, offload_cpu):
    model = make_llama(n_layers=2)
    main_threads = torch.get_num_threads()  # 1 under the one_thread fixture
    offload_cpu(n_persist=0, activation_mode="keep", cpu_threads=main_threads + 1)
    model.to("cpu")
    worker = rt.runtime_of(model).cpu_optim.worker
    assert worker.submit(torch.get_num_threads).result() == main_threads + 1
    assert torch.get_num_threads() == main_threads, "the main thread's count changed"


def test_the_measured_profiling_step_starts_after_the_cpu_update(make_llama, offload_cpu):
    """The second (measured) profiling step must not overlap the first step's CPU update: its
    block timings would then measure a host busy with the update (made the predicted step 2x
    too long on an H100). After that, step() returns before the update again."""
    from autooffload.runtime.update.cpu_optimizer import CpuOptimizer

    model = make_llama(n_layers=2)
    offload_cpu()  # the auto plan: two conservative profiling steps, then the searched plan
    model.to("cpu")
    runtime = rt.runtime_of(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    slow_update = CpuOptimizer._update

    def update_slowly(self, *args):
        threading.Event().wait(0.05)
        slow_update(self, *args)

    CpuOptimizer._update = update_slowly
    try:
        model(input_ids=ids, labels=ids).loss.backward()
        queued = sum(1 for c in runtime.layout.chunks if c.index not in runtime.manager.persistent)
        optimizer.step()
        assert runtime.cpu_optim.updates == queued, "the measured step would overlap the update"
        optimizer.zero_grad()
    finally:
        CpuOptimizer._update = slow_update


class _CountCalls(torch.overrides.TorchFunctionMode):
    """Names the torch functions and tensor methods called from Python while active
    (attribute reads and writes, ``__get__`` / ``__set__``, left out: no op runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name not in ("__get__", "__set__"):
            self.names.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("hidden", [32, 64], ids=["h32", "h64"])
def test_the_workers_copies_are_one_op_per_chunk_whatever_its_param_count(
    make_llama, offload_cpu, hidden
):
    """Each torch call from the worker returns to Python and needs the GIL back, which the
    main thread (a launch-bound forward, a checkpointed recompute) holds for up to 5 ms: the
    gradient copies, the accumulations and the masters' write-back are one foreach op per
    chunk, not one op per param (on the H100 that was ~100 waits per chunk of a 3.6B model)."""
    model = make_llama(n_layers=2, hidden=hidden).to(torch.bfloat16)
    offload_cpu(n_persist=0, activation_mode="keep", master_weights=True, chunk_size=1 << 20)
    model.to("cpu")
    runtime = rt.runtime_of(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    cpu = runtime.cpu_optim
    cpu.wait()
    chunk = max(runtime.layout.chunks, key=lambda c: len(c.trainable_slots))
    slots = chunk.trainable_slots
    assert len(slots) >= 9  # a whole decoder layer at least
    for slot in slots:
        cpu.masters[id(slot.param)].grad = None
    staged = [cpu.manager.grads.staging_view(slot, chunk).float() for slot in slots]
    for expected_factor in (1, 2):  # a copy of the staging, then an accumulation onto it
        with _CountCalls() as counted:
            cpu.staging._accumulate(chunk, slots, None)
        assert len(counted.names) <= 2, counted.names
        for slot, value in zip(slots, staged, strict=True):
            grad = cpu.masters[id(slot.param)].grad
            torch.testing.assert_close(grad, value * expected_factor, rtol=0, atol=0)
    twin = cpu.twins.twin(chunk, optimizer)
    hyper = cpu.twins.hyper(chunk, optimizer)
    with _CountCalls() as counted:
        cpu._update(chunk, twin, hyper, 1.0)
    assert "copy_" not in counted.names, counted.names
    assert counted.names.count("_foreach_copy_") == 1, counted.names
    for slot in slots:
        host = cpu.manager.host_view(slot, chunk)
        assert torch.equal(host, cpu.masters[id(slot.param)].bfloat16()), slot.name
    assert cpu.updated_params >= sum(slot.numel for slot in slots)


def _bf16_grads_after(make_llama, offload_cpu, micro_batches: int) -> tuple[dict, dict]:
    """Host gradients (fp32 masters) of an offloaded bf16 model after ``micro_batches``
    backwards, by parameter name, and its CPU optimizer's counters."""
    torch.manual_seed(0)
    model = make_llama(n_layers=2, hidden=64).to(torch.bfloat16)
    offload_cpu(n_persist=0, activation_mode="keep", master_weights=True, chunk_size=1 << 20)
    model.to("cpu")
    cpu = rt.runtime_of(model).cpu_optim
    for micro in range(micro_batches):
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(micro))
        model(input_ids=ids, labels=ids).loss.backward()
    cpu.wait()
    names = {id(p): n for n, p in model.named_parameters()}
    grads = {names[pid]: m.grad.clone() for pid, m in cpu.masters.items() if m.grad is not None}
    stats = {
        "split": len(cpu.staging.add_views),
        "added": cpu.staging.added_params,
        "add_s": cpu.staging.add_s,
        "updated": cpu.updated_params,
        "offloaded": sum(m.numel() for m in cpu.masters.values()),
    }
    autooffload.disable()
    return grads, stats


def test_mixed_dtype_adds_in_views_equal_the_whole_tensor_add(make_llama, offload_cpu, monkeypatch):
    """bf16 gradients added onto fp32 host gradients as ACCUMULATE_BLOCK views (torch casts a
    whole mixed-dtype operand into a fresh temporary per add: 4x slower at 64M elements) are
    the same elementwise adds: bit-identical sums. The adds are counted apart from the update
    (the cost model's accumulation rate)."""
    whole, stats_whole = _bf16_grads_after(make_llama, offload_cpu, micro_batches=3)
    assert stats_whole["split"] == 0, "no param exceeds the default block: nothing split"
    monkeypatch.setattr(grad_staging, "ACCUMULATE_BLOCK", 100)
    split, stats = _bf16_grads_after(make_llama, offload_cpu, micro_batches=3)
    assert stats["split"] > 0, "the small block split no param"
    assert whole.keys() == split.keys() and whole
    for name, grad in whole.items():
        assert torch.equal(split[name], grad), name
    # Two adds per param (the first micro-batch's gradients are copied), none of them updates.
    assert stats["added"] == 2 * stats["offloaded"] > 0
    assert stats["add_s"] > 0 and stats["updated"] == 0


def test_an_accumulation_does_not_hold_back_the_next_gather(make_llama, offload_cpu):
    """The adds touch host gradients and staging, not the weights the next micro-batch's
    forward gathers: ``host_busy`` stays free of them, ``grads_busy`` (which a GPU update of
    the gradients waits for) and ``staging_busy`` hold them."""
    model = make_llama(n_layers=2, hidden=32)
    offload_cpu(n_persist=0, activation_mode="keep", chunk_size=1 << 20)
    model.to("cpu")
    runtime = rt.runtime_of(model)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    manager, cpu = runtime.manager, runtime.cpu_optim
    trained = [c.index for c in manager.chunks if c.trainable_slots]
    assert trained and all(manager.host_busy.get(i) is None for i in trained)
    assert all(cpu.staging.grads_busy[i] is manager.grads.staging_busy.get(i) for i in trained)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.step()
    # The update writes the weights: the gather waits for it, and so does a GPU update.
    assert all(manager.host_busy.get(i) is cpu.staging.grads_busy[i] for i in trained)


def test_a_layer_frozen_between_backward_and_step_is_stepped_like_plain(
    make_llama, offload_cpu, make_batches
):
    """Torch's optimizers step every param holding a gradient, frozen since its backward or
    not: the offloaded ones with host gradients too."""
    base = make_llama(n_layers=2)
    data = make_batches(3)
    runs = []
    for attached in (False, True):
        model = copy.deepcopy(base)
        if attached:
            offload_cpu(n_persist=0, activation_mode="keep")
            model.to("cpu")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        for step, ids in enumerate(data):
            model(input_ids=ids, labels=ids).loss.backward()
            if step == 1:
                model.model.layers[0].requires_grad_(False)
            optimizer.step()
            optimizer.zero_grad()
        autooffload.disable()
        runs.append({k: v.clone() for k, v in model.state_dict().items()})
    for name, value in runs[0].items():
        torch.testing.assert_close(runs[1][name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("then", ["step", "clip_then_step", "accumulate_then_step"])
def test_gradients_of_a_backward_before_detach_are_the_params_grads_after(
    make_llama, offload_cpu, make_batches, then
):
    """``disable()`` between a backward and ``step()``: the offloaded params' host gradients
    (clipped where clipping is pending) become their ``.grad``, as plain torch keeps them, so
    the loop goes on like plain."""
    base = make_llama(n_layers=2)
    data = make_batches(3)
    runs = []
    for attached in (False, True):
        model = copy.deepcopy(base)
        if attached:
            offload_cpu(n_persist=0, activation_mode="keep", update_in_backward=False)
            model.to("cpu")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        model(input_ids=data[0], labels=data[0]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model(input_ids=data[1], labels=data[1]).loss.backward()
        if then == "clip_then_step":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        autooffload.disable()
        if then == "accumulate_then_step":
            model(input_ids=data[2], labels=data[2]).loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        runs.append((grads, {k: v.clone() for k, v in model.state_dict().items()}))
    (plain_grads, plain), (grads, weights) = runs
    for name, value in plain_grads.items():
        torch.testing.assert_close(grads[name], value, rtol=1e-5, atol=1e-7, msg=name)
    for name, value in plain.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=name)
