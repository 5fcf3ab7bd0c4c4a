"""``autooffload.attach(model, optimizer)`` without ``enable()`` trains exactly like plain torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.utils
from runtime.runtime_models import CHUNK_SIZE, batches, tiny_llama

import autooffload
from autooffload import patches
from autooffload import runtime as rt
from autooffload.patches import _registry

STEPS = 3


def _train(
    attach: dict | None,
    *,
    clip: float | None = None,
    accumulate: int = 1,
    fused: bool = True,
    device: str = "cpu",
) -> tuple[list[float], dict[str, torch.Tensor], dict]:
    """An ordinary loop (backward, optional clipping, step, zero_grad) on the tiny Llama."""
    model = tiny_llama()
    if attach is None:
        model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    if attach is not None:
        autooffload.attach(model, optimizer, device=device, chunk_size=CHUNK_SIZE, **attach)
    losses = []
    for step, ids in enumerate(batches(STEPS * accumulate)):
        ids = ids.to(device)
        loss = model(input_ids=ids, labels=ids).loss / accumulate
        loss.backward()
        losses.append(loss.item())
        if (step + 1) % accumulate:
            continue
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    state = optimizer.state_dict()
    if attach is not None:
        rt.detach(model)
    weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return losses, weights, state


def _assert_same_state(got: dict, want: dict) -> None:
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for index, expected in want["state"].items():
        for key, value in expected.items():
            torch.testing.assert_close(got["state"][index][key], value, rtol=0, atol=0)


@pytest.mark.parametrize(
    "attach",
    [{"n_persist": 0}, {}, {"n_persist": 0, "n_checkpoint": 3}],
    ids=["n_persist=0", "default-plan", "checkpointed"],
)
def test_attach_without_enable_trains_bit_exactly_like_plain(attach):
    assert not patches.is_installed()
    plain_losses, plain_weights, plain_state = _train(None)
    losses, weights, state = _train(attach)
    assert losses == plain_losses
    for name, value in plain_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0, msg=name)
    assert len(state["state"]) == sum(1 for _ in tiny_llama().parameters())
    _assert_same_state(state, plain_state)


def test_attach_without_enable_clips_and_accumulates_over_host_gradients():
    plain = _train(None, clip=0.05, accumulate=2)
    attached = _train({"n_persist": 0}, clip=0.05, accumulate=2)
    assert attached[0] == plain[0]
    for name, value in plain[1].items():
        torch.testing.assert_close(attached[1][name], value, rtol=0, atol=0, msg=name)


def test_default_adamw_kernel_differs_only_by_rounding():
    """torch's default (foreach) AdamW against the CPU side's fused kernel: equal up to the two
    kernels' rounding, the same gap as two plain runs that differ only in the kernel."""
    _, foreach_weights, _ = _train(None, fused=False)
    _, fused_weights, _ = _train(None, fused=True)
    _, attached_weights, _ = _train({"n_persist": 0}, fused=False)
    for name, value in foreach_weights.items():
        kernels_gap = (fused_weights[name] - value).abs().max().item()
        attached_gap = (attached_weights[name] - value).abs().max().item()
        assert attached_gap <= max(2 * kernels_gap, 1e-6), name
        torch.testing.assert_close(attached_weights[name], value, rtol=0, atol=2e-4)


def test_attach_without_enable_patches_only_while_attached():
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    assert not _registry.records()
    autooffload.attach(model, optimizer, device="cpu", chunk_size=CHUNK_SIZE, n_persist=0)
    wrapped = {(r.owner.__name__, r.attr) for r in _registry.records()}
    assert ("Optimizer", "step") not in wrapped  # the step goes through torch's step hooks
    assert {("Optimizer", "zero_grad"), ("Module", "_apply")} <= wrapped
    # Nothing that changes objects attach() was not given: no attach-on-move, no masking.
    assert not any(owner.endswith("Collator") for owner, _ in wrapped)
    other = tiny_llama(seed=3)
    assert other.to("cpu") is other and rt.runtime_of(other) is None
    assert not patches.is_installed()
    rt.detach(model)
    assert not _registry.records()


def test_enable_after_attach_takes_over_and_disable_restores_everything():
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    autooffload.attach(model, optimizer, device="cpu", chunk_size=CHUNK_SIZE, n_persist=0)
    autooffload.enable(device="cpu", mask=False, log="warning")
    owners = [(r.owner, r.attr) for r in _registry.records()]
    assert len(owners) == len(set(owners))  # each wrapped once, not once per mode
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    assert len(optimizer.state_dict()["state"]) == sum(1 for _ in model.parameters())
    autooffload.disable()
    assert not _registry.records() and not rt.runtimes()


def test_converting_an_explicitly_attached_model_is_refused():
    model = tiny_llama()
    autooffload.attach(model, device="cpu", chunk_size=CHUNK_SIZE, n_persist=0)
    with pytest.raises(autooffload.AttachError, match="attached"):
        model.half()
    assert rt.runtime_of(model) is not None
    rt.detach(model)
    assert not _registry.records()
    assert model.half() is model  # an ordinary module again


@pytest.mark.gpu
def test_attach_without_enable_on_cuda_trains_like_plain():
    """On a GPU the offloaded chunks' update runs on the CPU (fused AdamW there, fused CUDA AdamW
    in the plain run): equal up to the two kernels' rounding."""
    plain_losses, plain_weights, _ = _train(None, device="cuda", clip=0.05)
    losses, weights, state = _train({"n_persist": 0}, device="cuda", clip=0.05)
    assert len(state["state"]) == sum(1 for _ in tiny_llama().parameters())
    torch.testing.assert_close(losses, plain_losses, rtol=1e-5, atol=1e-5)
    for name, value in plain_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-5, msg=name)
