"""The chunked causal-LM loss equals transformers' ForCausalLMLoss and never upcasts all logits."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.loss.loss_utils import ForCausalLMLoss

from autooffload.runtime.activations.chunked_ce import chunked_causal_lm_loss, rows_per_chunk

VOCAB = 97


class LargestFloat32(TorchDispatchMode):
    """Records the most elements of any fp32 tensor an op produces while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32:
                self.largest = max(self.largest, tensor.numel())
        return out


def make_inputs(dtype: torch.dtype, ignore_fraction: float = 0.3, bs: int = 3, seq: int = 17):
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(bs, seq, VOCAB, generator=generator) * 3).to(dtype)
    labels = torch.randint(0, VOCAB, (bs, seq), generator=generator)
    labels[torch.rand(bs, seq, generator=generator) < ignore_fraction] = -100
    return logits, labels


def loss_and_grad(fn, logits: torch.Tensor, **kwargs):
    leaf = logits.detach().clone().requires_grad_()
    loss = fn(leaf, vocab_size=VOCAB, **kwargs)
    (loss * 1.7).backward()
    assert torch.equal(leaf, logits)  # the logits the caller holds are never written
    return loss.detach(), leaf.grad


@pytest.mark.parametrize("chunk_rows", [1, 5, 16, 1000])
@pytest.mark.parametrize(
    "num_items", [None, 40, torch.tensor(33)], ids=["mean", "int-items", "tensor-items"]
)
def test_fp32_loss_and_grad_match_transformers(chunk_rows, num_items):
    logits, labels = make_inputs(torch.float32)
    kwargs = dict(labels=labels, num_items_in_batch=num_items)
    expected_loss, expected_grad = loss_and_grad(ForCausalLMLoss, logits, **kwargs)
    loss, grad = loss_and_grad(chunked_causal_lm_loss, logits, chunk_rows=chunk_rows, **kwargs)
    assert loss.dtype == expected_loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-6)
    assert torch.equal(grad, expected_grad)  # same kernels per row: bitwise


def test_shift_labels_and_custom_ignore_index():
    logits, labels = make_inputs(torch.float32)
    shift = labels.clone()
    shift[shift == -100] = 7  # 7 is a real class id and the ignore index here
    kwargs = dict(labels=None, shift_labels=shift, ignore_index=7)
    expected_loss, expected_grad = loss_and_grad(ForCausalLMLoss, logits, **kwargs)
    loss, grad = loss_and_grad(chunked_causal_lm_loss, logits, chunk_rows=4, **kwargs)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-6)
    assert torch.equal(grad, expected_grad)


def test_every_label_ignored_gives_nan_like_transformers():
    logits, labels = make_inputs(torch.float32, ignore_fraction=1.1)
    expected_loss, expected_grad = loss_and_grad(ForCausalLMLoss, logits, labels=labels)
    loss, grad = loss_and_grad(chunked_causal_lm_loss, logits, labels=labels, chunk_rows=4)
    assert expected_loss.isnan() and loss.isnan()
    assert torch.equal(grad, expected_grad)  # all zeros: ignored rows get no gradient


# bf16: both paths upcast, run the same fp32 kernels per row and cast the gradient to bf16; only
# the loss's sum over rows runs in another order (fp32 rounding).
BF16_LOSS_TOL = dict(rtol=1e-5, atol=1e-5)


def test_bf16_logits_match_transformers_and_grad_keeps_dtype():
    logits, labels = make_inputs(torch.bfloat16)
    expected_loss, expected_grad = loss_and_grad(ForCausalLMLoss, logits, labels=labels)
    loss, grad = loss_and_grad(chunked_causal_lm_loss, logits, labels=labels, chunk_rows=8)
    assert grad.dtype == torch.bfloat16 and loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected_loss, **BF16_LOSS_TOL)
    assert torch.equal(grad, expected_grad)


def test_bf16_autocast_lm_head_matches_transformers():
    torch.manual_seed(0)
    head = torch.nn.Linear(32, VOCAB, bias=False)
    hidden = torch.randn(2, 24, 32)
    _, labels = make_inputs(torch.float32, bs=2, seq=24)
    results = []
    for fn, extra in ((ForCausalLMLoss, {}), (chunked_causal_lm_loss, {"chunk_rows": 5})):
        head.zero_grad()
        leaf = hidden.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn(head(leaf), labels, vocab_size=VOCAB, **extra)
        loss.backward()
        results.append((loss.detach(), leaf.grad, head.weight.grad.clone()))
    (expected_loss, *expected_grads), (loss, *grads) = results
    torch.testing.assert_close(loss, expected_loss, **BF16_LOSS_TOL)
    for grad, expected in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected, rtol=2e-2, atol=1e-4)


def test_largest_fp32_tensor_is_one_chunk_not_all_logits():
    logits, labels = make_inputs(torch.bfloat16, bs=2, seq=64)
    n_rows = logits.shape[0] * logits.shape[1]
    for fn, extra in ((ForCausalLMLoss, {}), (chunked_causal_lm_loss, {"chunk_rows": 8})):
        leaf = logits.clone().requires_grad_()
        with LargestFloat32() as probe:
            fn(leaf, labels, vocab_size=VOCAB, **extra).backward()
        if fn is ForCausalLMLoss:
            assert probe.largest == n_rows * VOCAB  # the whole upcast
        else:
            assert probe.largest <= max(8 * VOCAB, n_rows)


def test_rows_per_chunk_bounds_the_fp32_chunk():
    assert rows_per_chunk(128256, 128 << 20) == 261
    assert rows_per_chunk(10**9, 1) == 1
