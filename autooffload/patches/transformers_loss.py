"""transformers patch: the causal-LM loss runs chunk by chunk (no fp32 copy of all the logits).

Every transformers causal LM computes its loss as ``self.loss_function(logits=..., labels=...,
vocab_size=..., **kwargs)``, where the ``PreTrainedModel.loss_function`` property returns the
model's own ``_loss_function`` if one was set, else ``LOSS_MAPPING[loss_type]``. The property is
wrapped: when what it returns is transformers' ``ForCausalLMLoss`` itself, the call goes to
:func:`autooffload.runtime.activations.chunked_ce.chunked_causal_lm_loss` (same arguments, same
math); any other loss function (a user's, a model's own) is called unchanged. ``LOSS_MAPPING`` and
``ForCausalLMLoss`` stay untouched, so code that compares against them by identity (the
Trainer's ``num_items_in_batch`` counting does) sees no difference. Setting
``AUTOOFFLOAD_CHUNKED_LOSS=0`` keeps transformers' loss. A fused LM head's placeholder logits
(``runtime/activations/fused_head.py``) get the loss its forward computed, whatever that setting.
"""

from __future__ import annotations

import sys
from typing import Any

import wrapt

from autooffload.patches import _registry
from autooffload.settings import Settings

TARGETS = ("transformers.modeling_utils",)


class _PropertyWrapper(wrapt.FunctionWrapper):
    """A wrapt wrapper around a property that keeps the property's setter working."""

    def __set__(self, instance: Any, value: Any) -> None:
        self.__wrapped__.__set__(instance, value)

    def __delete__(self, instance: Any) -> None:
        self.__wrapped__.__delete__(instance)


def _loss_wrapper(chunked: bool) -> Any:
    def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        """Called with ``wrapped`` = the loss function the property returned for ``instance``."""
        from transformers.loss.loss_utils import ForCausalLMLoss

        from autooffload.runtime.activations.chunked_ce import chunked_causal_lm_loss
        from autooffload.runtime.activations.fused_head import loss_for

        if wrapped is not ForCausalLMLoss:
            return wrapped(*args, **kwargs)
        logits = kwargs.get("logits", args[0] if args else None)
        labels = kwargs.get("labels", args[1] if len(args) > 1 else None)
        fused = loss_for(logits, labels, kwargs)
        if fused is not None:
            return fused
        if not chunked:
            return wrapped(*args, **kwargs)
        return chunked_causal_lm_loss(*args, **kwargs)

    return wrapper


def install(settings: Settings, target: str) -> None:
    # The fused LM head's placeholder logits go to its own loss through this wrapper too.
    if not settings.chunked_loss and settings.fused_head is False:
        return
    pretrained = sys.modules[target].PreTrainedModel
    if isinstance(pretrained.__dict__.get("loss_function"), property):
        _registry.wrap(
            pretrained,
            "loss_function",
            _loss_wrapper(settings.chunked_loss),
            __name__,
            _PropertyWrapper,
        )


def uninstall() -> None:
    _registry.restore_group(__name__)
