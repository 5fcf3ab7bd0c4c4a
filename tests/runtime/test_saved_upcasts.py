"""Saved upcasts kept as their source: the same gradients bit for bit, fewer saved bytes, the
outer saved-tensor hooks (checkpoint, a swap-like copy, a count) composed, in-place changes
caught."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from autooffload.runtime.activations.saved_upcasts import register, saving_sources

BF16, FP32 = torch.bfloat16, torch.float32


def _params(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(32, 16, generator=g).to(BF16)
    a = torch.randn(4, 16, generator=g, dtype=FP32).requires_grad_()
    b = torch.randn(32, 4, generator=g, dtype=FP32).requires_grad_()
    return base, a, b


def _lora(x: torch.Tensor, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, shared: bool):
    """Two LoRA projections of one bf16 input with fp32 adapters, each upcasting the input as
    PEFT does (``_cast_input_dtype``) before its ``lora_A``."""

    def projection() -> torch.Tensor:
        out = x @ base.t()
        y = x.to(FP32)
        if shared:
            register(y, x)
        return out + ((y @ a.t()) @ b.t()).to(BF16)

    if not shared:
        return projection() + projection()
    with saving_sources():
        first = projection()
    with saving_sources():
        return first + projection()


def _grads(shared: bool, wrap=None) -> list[torch.Tensor]:
    base, a, b = _params()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).to(BF16).requires_grad_()
    run = (
        (lambda: _lora(x * 1, base, a, b, shared)) if wrap is None else wrap(x, base, a, b, shared)
    )
    loss = run().float().pow(2).sum()
    loss.backward()
    return [x.grad, a.grad, b.grad]


def test_gradients_equal_plain_autograd_bit_for_bit() -> None:
    for got, want in zip(_grads(True), _grads(False), strict=True):
        assert torch.equal(got, want)


def test_the_source_is_saved_in_place_of_its_upcast() -> None:
    """Counted by an outer hook: each projection saved the fp32 upcast (8 x 16 x 4 bytes);
    now the bf16 source (8 x 16 x 2 bytes), with everything else as before."""

    def counted(shared: bool) -> tuple[int, list[torch.dtype]]:
        dtypes: list[torch.dtype] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            dtypes.append(t.dtype)
            return t

        base, a, b = _params()
        x = torch.randn(8, 16).to(BF16).requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _lora(x * 1, base, a, b, shared).float().sum().backward()
        return dtypes

    plain, shared = counted(False), counted(True)
    assert len(plain) == len(shared)
    assert plain.count(FP32) - shared.count(FP32) == 2  # the two upcasts
    assert shared.count(BF16) - plain.count(BF16) == 2  # their source, twice


def test_composes_with_checkpoint_and_a_swap_like_outer_hook() -> None:
    def checkpointed(x, base, a, b, shared):
        return lambda: checkpoint(_lora, x * 1, base, a, b, shared, use_reentrant=False)

    def copied(x, base, a, b, shared):
        def pack(t: torch.Tensor) -> torch.Tensor:
            return t.detach().clone()  # a copy elsewhere, as a swap to host memory makes

        def run() -> torch.Tensor:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                return _lora(x * 1, base, a, b, shared)

        return run

    want = _grads(False)
    for wrap in (checkpointed, copied):
        for got, expected in zip(_grads(True, wrap), want, strict=True):
            assert torch.equal(got, expected), wrap.__name__


def test_an_in_place_change_of_a_saved_source_raises_before_a_wrong_gradient() -> None:
    base, a, b = _params()
    x = torch.randn(8, 16).to(BF16).requires_grad_()
    h = x * 1
    loss = _lora(h, base, a, b, True).float().sum()
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match="AUTOOFFLOAD_SAVED_UPCASTS=0"):
        loss.backward()


def test_outside_a_scope_or_for_a_narrowing_cast_the_upcast_is_saved_itself() -> None:
    saved: list[torch.dtype] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.dtype)
        return t

    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, 4)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = x.to(torch.float64)
        register(y, x)  # no scope
        (y @ w).sum().backward()
        with saving_sources():
            z = x.to(torch.float16)
            register(z, x)  # narrowing: not exact
            (z.double() @ w).sum().backward()
    assert saved == [torch.float64, torch.float64]


def test_a_graph_never_run_backward_frees_what_the_scope_saved() -> None:
    """Saved tensors are held detached: a saved output (``exp`` saves its result) held with its
    ``grad_fn`` would be a cycle through autograd's nodes that nothing frees."""
    import gc
    import weakref

    x = torch.randn(64, dtype=BF16, requires_grad=True)
    with saving_sources():
        y = x.to(FP32)
        register(y, x)
        out = torch.exp(y * 2)
        loss = out.sum()
    gone = weakref.ref(out)
    del out, loss, y
    gc.collect()
    assert gone() is None
