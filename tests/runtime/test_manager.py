"""ChunkManager residency on CPU: gather / release / prefetch, gradient offload, teardown."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
import torch
from torch import nn

import autooffload
from autooffload import runtime as rt
from autooffload.runtime.chunks.layout import build_layout
from autooffload.runtime.chunks.store import ChunkManager, Residency

pytestmark = pytest.mark.usefixtures("one_thread")

N_CHUNKS = 5


def _manager(persistent=(0,), n_buffer: int = 2) -> tuple[ChunkManager, nn.Sequential]:
    """Five Linear(8, 8) layers, one per chunk (288 aligned bytes each), chunk 0 persistent."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(N_CHUNKS)])
    groups = [(i, list(layer.named_parameters())) for i, layer in enumerate(model)]
    layout = build_layout(groups, chunk_size=320)
    assert len(layout.chunks) == N_CHUNKS
    manager = ChunkManager(
        layout, torch.device("cpu"), persistent=persistent, n_buffer=n_buffer, pin_memory=False
    )
    return manager, model


def _storage_bytes(manager: ChunkManager, index: int) -> int:
    return manager.gpu_flat[index].untyped_storage().nbytes()


def test_adopt_keeps_persistent_chunks_resident_and_frees_the_rest():
    manager, model = _manager()
    expected = [layer.weight.detach().clone() for layer in model]
    manager.adopt_params()
    assert manager.state == [Residency.RESIDENT] + [Residency.HOST] * (N_CHUNKS - 1)
    assert _storage_bytes(manager, 0) == manager.chunks[0].nbytes
    assert all(_storage_bytes(manager, i) == 0 for i in range(1, N_CHUNKS))
    # Shapes stay readable while the bytes are on the host.
    assert all(layer.weight.shape == (8, 8) for layer in model)
    assert torch.equal(model[0].weight, expected[0])
    for chunk, weight in zip(manager.chunks, expected):
        assert torch.equal(manager.host_view(chunk.slots[0], chunk), weight)


def test_gather_fills_the_chunk_with_the_host_bytes_and_release_frees_them():
    manager, model = _manager()
    expected = model[2].weight.detach().clone()
    manager.adopt_params()
    manager.gather(2)
    assert manager.state[2] == Residency.RESIDENT
    assert _storage_bytes(manager, 2) == manager.chunks[2].nbytes
    assert torch.equal(manager.gpu_flat[2], manager.host.view(2))
    assert torch.equal(model[2].weight, expected)
    manager.release(2)
    assert manager.state[2] == Residency.HOST
    assert _storage_bytes(manager, 2) == 0
    assert model[2].weight.shape == (8, 8)


def test_gather_again_sees_host_updates_made_while_released():
    manager, model = _manager()
    manager.adopt_params()
    chunk = manager.chunks[3]
    manager.host_view(chunk.slots[0], chunk).fill_(7.0)
    manager.gather(3)
    assert torch.equal(model[3].weight, torch.full((8, 8), 7.0))


def test_release_of_a_persistent_chunk_is_a_no_op():
    manager, model = _manager()
    manager.adopt_params()
    weight = model[0].weight.detach().clone()
    manager.release(0)
    manager.release_all()
    assert manager.state[0] == Residency.RESIDENT
    assert _storage_bytes(manager, 0) == manager.chunks[0].nbytes
    assert torch.equal(model[0].weight, weight)
    assert not manager.prefetch(0)


def test_prefetch_never_uses_more_than_n_buffer_buffers():
    manager, _ = _manager(n_buffer=2)
    manager.adopt_params()
    assert manager.prefetch(1)
    assert manager.prefetch(2)
    assert manager.state[1] == manager.state[2] == Residency.IN_FLIGHT
    assert not manager.prefetch(3), "a third buffer was used with n_buffer=2"
    assert manager.state[3] == Residency.HOST and _storage_bytes(manager, 3) == 0
    assert not manager.prefetch(1), "a chunk already in flight was copied again"
    manager.gather(1)
    assert manager.state[1] == Residency.RESIDENT
    assert not manager.prefetch(3), "a gathered chunk still holds its buffer"
    manager.release(1)
    assert manager.prefetch(3)
    assert manager.n_in_use() == 2


def test_prefetch_waits_for_cpu_work_on_the_host_bytes():
    """A chunk whose optimizer update is still running must not be copied half-updated."""
    manager, _ = _manager()
    manager.adopt_params()
    update = Future()
    manager.host_busy.set(1, update)
    assert not manager.prefetch(1)
    assert manager.state[1] == Residency.HOST
    update.set_result(None)
    assert manager.prefetch(1)


def test_offload_grads_stages_the_gradient_and_drops_it_from_the_param():
    manager, model = _manager()
    manager.adopt_params()
    received = []
    manager.grads.connect_update(
        lambda chunk, slots, event, norms, presence, summed: received.append((chunk.index, slots)),
        None,
        None,
        None,
    )
    manager.gather(2)
    grad_w, grad_b = torch.randn(8, 8), torch.randn(8)
    model[2].weight.grad, model[2].bias.grad = grad_w.clone(), grad_b.clone()
    manager.grads.offload_grads(2)
    chunk = manager.chunks[2]
    assert [(i, [s.param for s in slots]) for i, slots in received] == [
        (2, [model[2].weight, model[2].bias])
    ]
    assert torch.equal(manager.grads.staging_view(chunk.slots[0], chunk), grad_w)
    assert torch.equal(manager.grads.staging_view(chunk.slots[1], chunk), grad_b)
    assert model[2].weight.grad is None and model[2].bias.grad is None


def test_offload_grads_leaves_persistent_chunks_to_the_user_optimizer():
    manager, model = _manager()
    manager.adopt_params()
    fail = lambda *args: pytest.fail("a persistent chunk's grads were offloaded")
    manager.grads.connect_update(fail, None, None, None)
    model[0].weight.grad = torch.ones(8, 8)
    manager.grads.offload_grads(0)
    assert torch.equal(model[0].weight.grad, torch.ones(8, 8))


def test_materialize_gives_every_param_its_own_full_storage():
    manager, model = _manager()
    expected = [layer.weight.detach().clone() for layer in model]
    manager.adopt_params()
    manager.gather(3)
    manager.materialize(torch.device("cpu"))
    for layer, weight in zip(model, expected):
        assert layer.weight.untyped_storage().nbytes() == 8 * 8 * 4
        assert torch.equal(layer.weight, weight)
    assert manager.host.total_bytes == 0


# ---- residency of an attached model ---------------------------------------------------------


def test_no_grad_forward_leaves_only_persistent_chunks_resident(make_llama, offload_cpu):
    model = make_llama()
    offload_cpu(n_persist=2)
    model.to("cpu").eval()
    manager = rt.runtime_of(model).manager
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids)
    assert manager.stats["gathers"] > 0
    for index, state in enumerate(manager.state):
        if index in manager.persistent:
            assert state == Residency.RESIDENT
        else:
            assert state == Residency.HOST, f"chunk {index} stayed resident after the forward"
            assert _storage_bytes(manager, index) == 0


def test_a_training_step_leaves_only_persistent_chunks_resident(make_llama, offload_cpu):
    model = make_llama()
    offload_cpu(n_persist=1)
    model.to("cpu")
    manager = rt.runtime_of(model).manager
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    assert manager.state == [Residency.RESIDENT] + [Residency.HOST] * (len(manager.chunks) - 1)
    assert all(
        p.grad is None for chunk in manager.chunks[1:] for p in (s.param for s in chunk.slots)
    ), "an offloaded param kept its device gradient after backward"


# ---- teardown ---------------------------------------------------------------------------------


def _optimizer_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("autooffload")]


def test_disable_after_training_returns_an_ordinary_model(make_llama, offload_cpu):
    model = make_llama(tied=True)
    offload_cpu(n_persist=2)
    model.to("cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    assert _optimizer_threads(), "the CPU optimizer never started its worker"
    runtime = rt.runtime_of(model)
    runtime.cpu_optim.wait()  # zero_grad returns before the CPU update is done
    trained = {}
    for chunk in runtime.layout.chunks:
        for slot in chunk.slots:
            if chunk.index in runtime.manager.persistent:
                trained[slot.name] = slot.param.detach().clone()
            else:
                trained[slot.name] = runtime.manager.host_view(slot, chunk).clone()

    autooffload.disable()

    assert rt.runtime_of(model) is None
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks, module
    for name, param in model.named_parameters():
        assert param.untyped_storage().nbytes() == param.numel() * param.element_size(), name
        assert type(param) is nn.Parameter and param.device.type == "cpu"
    assert model.lm_head.weight is model.model.embed_tokens.weight, "the tie was broken"
    named = dict(model.named_parameters())
    for slot_name, weight in trained.items():
        assert torch.equal(named[slot_name], weight), slot_name
    assert not _optimizer_threads(), "the CPU optimizer thread outlived disable()"
    # The detached model is plain PyTorch again: it trains without autooffload.
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters())
