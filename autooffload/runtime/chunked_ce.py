"""Cross-entropy over sequence chunks: the causal-LM loss without an fp32 copy of all the logits.

transformers' ``ForCausalLMLoss`` upcasts the whole ``(tokens, vocab)`` logits to fp32, and
``cross_entropy`` saves an fp32 log-softmax of that size for backward, whose backward makes two
more: at seq 8192 and vocab 128256 that is 4 GiB each next to the 2 GiB of bf16 logits.
:class:`ChunkedCrossEntropy` upcasts ``chunk_rows`` rows at a time in forward (keeping only one
fp32 log-sum-exp per row) and rebuilds the gradient chunk by chunk in backward, straight into a
tensor of the logits' own dtype. The math is that of ``F.cross_entropy(ignore_index=...)``:
``loss_i = logsumexp(x_i) - x_i[t_i]``, ``dloss_i/dx_i = softmax(x_i) - onehot(t_i)``, zero
for ignored rows.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

# fp32 bytes of one chunk of rows; forward holds about two chunks (the upcast and exp's temporary).
CHUNK_BYTES = 128 << 20


def rows_per_chunk(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows of ``vocab_size`` fp32 logits that fit in ``chunk_bytes`` (at least one)."""
    return max(1, chunk_bytes // (4 * max(1, vocab_size)))


class ChunkedCrossEntropy(torch.autograd.Function):
    """Sum over rows of ``-log_softmax(logits)[target]``, skipping ``ignore_index`` rows, in fp32.

    ``logits`` is ``(rows, vocab)`` of any float dtype; its gradient comes back in that dtype,
    computed in fp32 one chunk of rows at a time (as ``logits.float()`` + ``cross_entropy``
    would, then cast). Only the per-row log-sum-exp (fp32, ``rows`` values) is saved besides the
    logits themselves, which the caller's output holds anyway.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        ignore_index: int,
        chunk_rows: int,
    ) -> torch.Tensor:
        valid = targets != ignore_index
        safe_targets = torch.where(valid, targets, torch.zeros_like(targets))
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for start in range(0, logits.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            chunk = logits[rows].float()
            lse[rows] = torch.logsumexp(chunk, dim=-1)
            picked = chunk.gather(1, safe_targets[rows, None]).squeeze(1)
            del chunk
            total += torch.where(valid[rows], lse[rows] - picked, 0.0).sum()
        ctx.save_for_backward(logits, safe_targets, valid, lse)
        ctx.chunk_rows = chunk_rows
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        logits, safe_targets, valid, lse = ctx.saved_tensors
        grad_logits = torch.empty_like(logits, memory_format=torch.contiguous_format)
        scale = grad_total.float()
        for start in range(0, logits.shape[0], ctx.chunk_rows):
            rows = slice(start, start + ctx.chunk_rows)
            # copy=True: for fp32 logits .float() is the logits themselves, and this goes in place.
            probs = logits[rows].to(torch.float32, copy=True).sub_(lse[rows, None]).exp_()
            probs.scatter_add_(
                1,
                safe_targets[rows, None],
                torch.full((probs.shape[0], 1), -1.0, dtype=probs.dtype, device=probs.device),
            )
            probs.mul_(torch.where(valid[rows], scale, 0.0)[:, None])
            grad_logits[rows] = probs
            del probs
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
