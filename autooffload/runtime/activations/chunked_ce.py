"""Cross-entropy over sequence chunks: the causal-LM loss without an fp32 copy of all the logits.

transformers' ``ForCausalLMLoss`` upcasts the whole ``(tokens, vocab)`` logits to fp32, and
``cross_entropy`` saves an fp32 log-softmax of that size for backward, whose backward makes two
more: at seq 8192 and vocab 128256 that is 4 GiB each next to the 2 GiB of bf16 logits.
:class:`ChunkedCrossEntropy` upcasts ``chunk_rows`` rows at a time in forward (saving nothing
fp32) and recomputes each chunk's gradient in backward, straight into a tensor of the logits' own
dtype, with the same kernels as ``F.cross_entropy(ignore_index=...)``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

# fp32 bytes of one chunk of rows; a chunk's backward holds about four (upcast, log-softmax, grads).
CHUNK_BYTES = 128 << 20


def rows_per_chunk(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows of ``vocab_size`` fp32 logits that fit in ``chunk_bytes`` (at least one)."""
    return max(1, chunk_bytes // (4 * max(1, vocab_size)))


class ChunkedCrossEntropy(torch.autograd.Function):
    """Sum over rows of ``-log_softmax(logits)[target]``, skipping ``ignore_index`` rows, in fp32.

    ``logits`` is ``(rows, vocab)`` of any float dtype; its gradient comes back in that dtype.
    Each chunk of rows runs the very kernels of ``logits.float()`` + ``cross_entropy``: in
    forward, and again in backward (recomputed from the saved logits, differentiated with
    autograd), so the gradient is bitwise what transformers' loss gives; only the loss value's
    sum runs in a different order. Nothing but the logits (which the caller's output holds
    anyway) and the targets is saved.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        ignore_index: int,
        chunk_rows: int,
    ) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for start in range(0, logits.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            total += F.cross_entropy(
                logits[rows].float(), targets[rows], ignore_index=ignore_index, reduction="sum"
            )
        ctx.save_for_backward(logits, targets)
        ctx.ignore_index, ctx.chunk_rows = ignore_index, chunk_rows
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        logits, targets = ctx.saved_tensors
        grad_logits = torch.empty_like(logits, memory_format=torch.contiguous_format)
        for start in range(0, logits.shape[0], ctx.chunk_rows):
            rows = slice(start, start + ctx.chunk_rows)
            with torch.enable_grad():
                chunk = logits[rows].detach().float().requires_grad_()
                loss = F.cross_entropy(
                    chunk, targets[rows], ignore_index=ctx.ignore_index, reduction="sum"
                )
                (grad_chunk,) = torch.autograd.grad(loss, chunk, grad_total)
            grad_logits[rows] = grad_chunk
            del chunk, loss, grad_chunk
        return grad_logits, None, None, None


def chunked_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """transformers' ``fixed_cross_entropy`` over ``(rows, vocab)`` logits, chunk by chunk.

    Mean over non-ignored rows when ``num_items_in_batch`` is None (NaN when every row is
    ignored, as ``F.cross_entropy``), else the sum divided by ``num_items_in_batch``.
    """
    if chunk_rows is None:
        chunk_rows = rows_per_chunk(logits.shape[-1])
    targets = targets.to(logits.device)
    total = ChunkedCrossEntropy.apply(logits, targets, ignore_index, chunk_rows)
    if num_items_in_batch is None:
        return total / (targets != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def chunked_causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    chunk_rows: int | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` (same arguments, same result) without the fp32 logits.

    Labels are shifted left by one (the last position gets ``ignore_index``) unless
    ``shift_labels`` is given; extra ``kwargs`` are ignored, as transformers does.
    """
    if shift_labels is None:
        padded = F.pad(labels, (0, 1), value=ignore_index)  # type: ignore[arg-type]
        shift_labels = padded[..., 1:]
    return chunked_cross_entropy(
        logits.reshape(-1, vocab_size),
        shift_labels.reshape(-1),
        num_items_in_batch,
        ignore_index,
        chunk_rows,
    )
