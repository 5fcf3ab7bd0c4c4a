"""The LM head fused with the causal-LM loss: the logits of a long sequence never exist whole.

At seq 524,288 Llama-3's bf16 logits are 128 GiB, more than any GPU holds; at seq 32,768 they are
8 GiB, and their gradient as much again. The chunked loss (``chunked_ce.py``) removes the fp32
copies but not the bf16 logits the model's ``lm_head`` makes. :class:`FusedHead` removes those:
in a training forward given ``labels``, the head's forward computes the loss itself, ``rows`` of
logits at a time, and returns a placeholder in their place; the model passes it to its loss
function, which returns the loss computed there. The backward recomputes each chunk's logits and
takes their gradient to the head's input, weight and bias, a chunk at a time.

The head's own forward still runs inside the ``lm_head`` module's call, so the chunk store's
group hooks gather its weight (a head served from the host comes whole for each pass:
``host_vocab.served_head_pass``), the profiler times it, and the backward hook on its output
(the placeholder) gathers it again for the backward.

Only where it is exact: the model's ``forward`` must go straight from ``self.lm_head(...)`` to
``self.loss_function(logits=...)`` with nothing reading the logits in between (no soft-capping,
no scaling: ``head_source.forward_check`` reads its source), the head must be a plain ``nn.Linear``,
and the loss function the one transformers maps causal LMs to (``ForCausalLMLoss``). Each
chunk's logits are the same dot products the whole head makes, the loss is transformers' sum
over rows in fp32 (added in another order), and each chunk's logits gradient is the very one
of ``logits.float()`` + ``cross_entropy``; the weight's gradient is summed over chunks in fp32.

What the user sees: ``outputs.logits`` is None in the training steps the head is fused
(``outputs.loss`` is the loss); evaluation, ``no_grad`` forwards and forwards without labels are
untouched. ``Settings.fused_head``: on, off, or auto (fused where the step's logits would take
at least ``AUTO_SHARE`` of the memory budget).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autooffload.errors import AttachError
from autooffload.log import logger, warn_once
from autooffload.runtime.activations.chunked_ce import rows_per_chunk
from autooffload.runtime.activations.head_source import find_causal_lm, fusable_reason
from autooffload.runtime.forward_wrap import install_forward, remove_forward

# Where the head module keeps its ``forward_wrap`` state.
_KEY = "_autooffload_fused_head"
# fp32 bytes of one chunk of logits rows: a chunk's backward holds the logits in their dtype, an
# fp32 upcast, its gradient and the gradient cast back (about 3x this).
FUSED_CHUNK_BYTES = 256 << 20
# ``fused_head`` auto: fused where the step's logits would take at least this share of the budget
# (a fused head costs one more head matmul a step: the backward recomputes the logits).
AUTO_SHARE = 0.25


@dataclass(eq=False)
class _Request:
    """One training forward's fused-head request: its targets, and what the head left."""

    labels: torch.Tensor
    targets: torch.Tensor  # the shifted labels, one per logits row
    ignore_index: int
    placeholder: torch.Tensor | None = None
    total: torch.Tensor | None = None  # the loss sum over rows (fp32), from the head's forward
    consumed: bool = False
    grad_scale: list[torch.Tensor] = field(default_factory=list)


class _FusedHead(torch.autograd.Function):
    """The head's forward without its logits: returns a placeholder of the logits' shape (one
    element, expanded) and leaves the loss sum on the request; the backward recomputes the
    logits chunk by chunk and returns the gradients of the head's input, weight and bias."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        logits_pass: Callable[[], Callable[[torch.Tensor], torch.Tensor]],
        request: _Request,
        vocab: int,
    ) -> torch.Tensor:
        logits_of = logits_pass()
        rows = x.reshape(-1, x.shape[-1])
        targets = request.targets
        chunk = rows_per_chunk(vocab, FUSED_CHUNK_BYTES)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        dtype = x.dtype
        for start in range(0, rows.shape[0], chunk):
            part = slice(start, start + chunk)
            logits = logits_of(rows[part])
            dtype = logits.dtype
            total += F.cross_entropy(
                logits.float(), targets[part], ignore_index=request.ignore_index, reduction="sum"
            )
            del logits
        request.total = total
        # The weight and bias are read from the head again in the backward (gathered there by
        # the group hooks), not saved: a saved parameter would go through saved-tensor hooks.
        ctx.save_for_backward(x)
        ctx.params = (weight, bias)
        ctx.logits_pass, ctx.request, ctx.chunk = logits_pass, request, chunk
        ctx.autocast = _autocast_state(x.device.type)
        return torch.zeros((), dtype=dtype, device=x.device).expand(*x.shape[:-1], vocab)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        weight, bias = ctx.params
        request: _Request = ctx.request
        scale = request.grad_scale.pop() if request.grad_scale else None
        if scale is None:  # the placeholder's gradient came from elsewhere than the loss
            raise RuntimeError(
                "autooffload: the fused LM head's placeholder logits were differentiated outside"
                " the loss; set AUTOOFFLOAD_FUSED_HEAD=0 to keep the logits"
            )
        rows = x.detach().reshape(-1, x.shape[-1])
        inputs_need = ctx.needs_input_grad
        grad_rows = torch.empty_like(rows) if inputs_need[0] else None
        trained = [t for t, need in ((weight, inputs_need[1]), (bias, inputs_need[2])) if need]
        sums = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in trained]
        device_type, enabled, dtype = ctx.autocast
        logits_of = ctx.logits_pass()
        for start in range(0, rows.shape[0], ctx.chunk):
            part = slice(start, start + ctx.chunk)
            with torch.enable_grad(), torch.autocast(device_type, dtype, enabled=enabled):
                piece = rows[part].requires_grad_(grad_rows is not None)
                logits = logits_of(piece)
                with torch.autocast(device_type, enabled=False):
                    upcast = logits.detach().float().requires_grad_()
                    loss = F.cross_entropy(
                        upcast,
                        request.targets[part],
                        ignore_index=request.ignore_index,
                        reduction="sum",
                    )
                    (grad_upcast,) = torch.autograd.grad(loss, upcast, scale)
                wanted = ([piece] if grad_rows is not None else []) + trained
                grads = torch.autograd.grad(logits, wanted, grad_upcast.to(logits.dtype))
            if grad_rows is not None:
                grad_rows[part] = grads[0]
                grads = grads[1:]
            for total, g in zip(sums, grads, strict=True):
                total += g
            del logits, upcast, loss, grad_upcast, grads, piece
        out: list[torch.Tensor | None] = [
            None if grad_rows is None else grad_rows.view(x.shape),
            None,
            None,
        ]
        summed = iter(sums)
        for position, tensor in ((1, weight), (2, bias)):
            if inputs_need[position]:
                out[position] = next(summed).to(tensor.dtype)
        return (*out, None, None, None)


class _FusedLoss(torch.autograd.Function):
    """The loss sum the fused head computed, as a function of its placeholder: the backward
    hands the fp32 gradient of the sum to the head's backward (through the request) and the
    placeholder an expanded zero, which the head's backward does not read."""

    @staticmethod
    def forward(ctx: Any, placeholder: torch.Tensor, request: _Request) -> torch.Tensor:  # type: ignore[override]
        ctx.request = request
        ctx.shape, ctx.dtype = placeholder.shape, placeholder.dtype
        assert request.total is not None
        return request.total.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        ctx.request.grad_scale.append(grad.float())
        zero = torch.zeros((), dtype=ctx.dtype, device=grad.device).expand(ctx.shape)
        return zero, None


def _autocast_state(device_type: str) -> tuple[str, bool, torch.dtype]:
    enabled = torch.is_autocast_enabled(device_type)
    return device_type, enabled, torch.get_autocast_dtype(device_type)


def _shifted_targets(
    labels: torch.Tensor, shift_labels: torch.Tensor | None, ignore_index: int
) -> torch.Tensor:
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels.reshape(-1)


class FusedHead:
    """The fused head of one attached model: a forward pre-hook takes a training step's labels,
    the head's forward (its own, or the host-served one) computes the loss, the loss function
    returns it, and a forward hook checks it was taken and drops the placeholder from the
    output. ``mode``: True, False or None (auto: see ``AUTO_SHARE``)."""

    def __init__(self, model: nn.Module, mode: bool | None, budget: int | None) -> None:
        self.model = model
        self.mode = mode
        self.budget = budget
        self.causal_lm: nn.Module | None = None
        self.head: nn.Module | None = None
        self._request: _Request | None = None
        self._handles: list[Any] = []
        self.fused_steps = 0
        if mode is False:
            return
        causal_lm = find_causal_lm(model)
        reason = "it is not a transformers causal LM" if causal_lm is None else None
        if causal_lm is not None:
            reason = fusable_reason(causal_lm)
        if reason is not None:
            if mode:
                raise AttachError(
                    f"AUTOOFFLOAD_FUSED_HEAD=1 cannot fuse {type(model).__name__}'s LM head with"
                    f" its loss: {reason}; set AUTOOFFLOAD_FUSED_HEAD to 0 or auto"
                )
            logger.debug("fused head: not for %s (%s)", type(model).__name__, reason)
            return
        self.causal_lm = causal_lm
        self.head = causal_lm.lm_head
        if mode is None and budget is None:
            return  # auto with no budget to compare the logits with: never fused
        self._handles = [
            model.register_forward_pre_hook(self._begin, with_kwargs=True, prepend=True),
            model.register_forward_hook(self._end, always_call=True),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._finish()

    def _finish(self) -> None:
        """End a fused forward: the head's own forward back (it is wrapped only while a fused
        forward runs, so a copy of the head made between steps, PEFT's ``modules_to_save``,
        copies a plain module)."""
        self._request = None
        if self.head is not None:
            remove_forward(self.head, _KEY)

    # ---- the step --------------------------------------------------------------------------

    def _wants(self, labels: torch.Tensor) -> bool:
        if self.mode:
            return True
        if self.budget is None or self.head is None:
            return False
        weight = self.head.weight
        kind = weight.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else weight.dtype
        logits_bytes = labels.numel() * weight.shape[0] * dtype.itemsize
        return logits_bytes >= AUTO_SHARE * self.budget

    def _begin(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._finish()
        labels = kwargs.get("labels")
        if not (module.training and torch.is_grad_enabled() and torch.is_tensor(labels)):
            return
        assert self.causal_lm is not None
        head = self.causal_lm.lm_head
        if type(head) is not nn.Linear:  # replaced since attach (PEFT's modules_to_save)
            if self.mode:
                raise RuntimeError(
                    f"autooffload: the LM head is now a {type(head).__name__}, not a plain"
                    " nn.Linear, and cannot be fused with the loss; set AUTOOFFLOAD_FUSED_HEAD=0"
                )
            return
        self.head = head
        if not self._wants(labels):
            return
        ignore_index = kwargs.get("ignore_index", -100)
        targets = _shifted_targets(labels, kwargs.get("shift_labels"), ignore_index)
        self._request = _Request(labels, targets, ignore_index)
        state = _HeadState(inner_forward=head.forward, prior_forward=None, owner=self)
        state.prior_forward = head.__dict__.get("forward")
        install_forward(head, _KEY, state, _head_forward)

    def _end(self, module: nn.Module, args: tuple, output: Any) -> Any:
        request = self._request
        self._finish()
        if request is None:
            return None  # not fused
        # The placeholder's graph holds the request (its backward reads it): a cycle keeping
        # the step's graph, and so the model, alive until a cyclic gc.
        placeholder, request.placeholder = request.placeholder, None
        if placeholder is None or output is None:
            return None  # not fused, or the forward raised
        if not request.consumed:
            raise RuntimeError(
                f"autooffload: {type(module).__name__}'s LM head was fused with the loss, but its"
                " logits did not reach transformers' causal-LM loss (a loss function set on the"
                " model?); set AUTOOFFLOAD_FUSED_HEAD=0"
            )
        self.fused_steps += 1
        warn_once(
            "fused-head-logits",
            "autooffload: the LM head is fused with the loss (the logits of the step are never"
            " made whole): outputs.logits is None in training steps with labels;"
            " AUTOOFFLOAD_FUSED_HEAD=0 keeps them",
        )
        return _drop_placeholder(output, placeholder)

    def fuse(
        self,
        module: nn.Module,
        x: torch.Tensor,
        logits_pass: Callable[[], Callable[[torch.Tensor], torch.Tensor]],
    ) -> torch.Tensor | None:
        """The placeholder logits of a fused forward of ``module`` (the head) on ``x``, or None
        when this forward is not fused (the caller computes the logits)."""
        request = self._request
        if request is None or module is not self.head:
            return None
        # A second head call in one forward is the OOM retry's re-run (the source check allows
        # one call): it replaces the first's placeholder.
        request.consumed, request.grad_scale = False, []
        if x.shape[:-1].numel() != request.targets.numel():
            if self.mode:
                raise RuntimeError(
                    f"autooffload: the LM head got {x.shape[:-1].numel()} rows for"
                    f" {request.targets.numel()} labels (logits_to_keep?); the fused head needs"
                    " one row per label: set AUTOOFFLOAD_FUSED_HEAD=0"
                )
            self._request = None
            return None
        request.targets = request.targets.to(x.device)
        weight, bias = module.weight, module.bias
        vocab = weight.shape[0]
        placeholder = _FusedHead.apply(x, weight, bias, logits_pass, request, vocab)
        request.placeholder = placeholder
        return placeholder

    def loss(self, logits: torch.Tensor, labels: Any, kwargs: dict) -> torch.Tensor | None:
        """The causal-LM loss for ``logits`` when they are this forward's placeholder (None
        otherwise), reduced as transformers' ``fixed_cross_entropy``."""
        request = self._request
        if request is None or logits is not request.placeholder:
            return None
        if labels is not request.labels or kwargs.get("ignore_index", -100) != request.ignore_index:
            raise RuntimeError(
                "autooffload: the fused LM head's loss was called with other labels than the"
                " forward's; set AUTOOFFLOAD_FUSED_HEAD=0"
            )
        request.consumed = True
        total = _FusedLoss.apply(logits, request)
        num_items = kwargs.get("num_items_in_batch")
        if num_items is None:
            return total / (request.targets != request.ignore_index).sum()
        if torch.is_tensor(num_items):
            num_items = num_items.to(total.device)
        return total / num_items


@dataclass(eq=False)
class _HeadState:
    inner_forward: Callable[..., Any]
    prior_forward: Any
    owner: FusedHead
    active: bool = True
    wrapper: Any = None


def _head_forward(state: _HeadState, args: tuple, kwargs: dict) -> torch.Tensor:
    """The head's forward: fused in a fused step (its logits from its own weight, or from the
    host store's tiles while it is served), else the forward it had."""
    module = state.owner.head
    if state.active and module is not None and len(args) == 1 and not kwargs:
        from autooffload.runtime.host_vocab import served_head_pass

        logits_pass = served_head_pass(module)
        if logits_pass is None:

            def logits_pass() -> Callable[[torch.Tensor], torch.Tensor]:
                return lambda rows: F.linear(rows, module.weight, module.bias)

        fused = state.owner.fuse(module, args[0], logits_pass)
        if fused is not None:
            return fused
    return state.inner_forward(*args, **kwargs)


def loss_for(logits: Any, labels: Any, kwargs: dict) -> torch.Tensor | None:
    """The fused loss when ``logits`` is an attached runtime's fused-head placeholder, else None
    (``patches/transformers_loss``)."""
    from autooffload.runtime import registry

    for runtime in registry.runtimes():
        loss = runtime.fused_head.loss(logits, labels, kwargs)
        if loss is not None:
            return loss
    return None


def _drop_placeholder(output: Any, placeholder: torch.Tensor) -> Any:
    """``output`` (a ``ModelOutput`` or a tuple) with None for the placeholder logits."""
    if isinstance(output, tuple):
        return tuple(None if item is placeholder else item for item in output)
    keys = getattr(output, "keys", None)
    if keys is not None:
        for key in list(keys()):
            if output[key] is placeholder:
                output[key] = None
    return None
