"""TRL patch: the fused LM head keeps the head's chunks on the device while it reads them.

TRL's fused LM head (``SFTTrainer``'s default loss since TRL 1.x, and the chunked divergence
losses) reads ``lm_head.weight`` directly, without calling the ``lm_head`` module, in its forward
and again in its autograd backward, so the head's group hooks never gather it. TRL brackets every
such read with ``maybe_gather_lm_head_ctx(weight, bias)`` (for DeepSpeed ZeRO-3); the wrapper
holds the chunks of those params on the device for the read, as ZeRO-3's gather does.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import wrapt

from autooffload.patches import _registry
from autooffload.settings import Settings

TARGETS = ("trl.trainer.utils", "trl.kernels.chunked_divergence")

_ATTR = "maybe_gather_lm_head_ctx"


@contextmanager
def _on_device(
    runtime: Any, params: list[torch.Tensor], inner: AbstractContextManager
) -> Iterator[None]:
    from autooffload.runtime.access import params_on_device

    with params_on_device(runtime, params), inner:
        yield


def _gather_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    from autooffload.runtime.access import runtime_managing

    params = [p for p in args if isinstance(p, torch.Tensor)]
    runtime = runtime_managing(params)
    if runtime is None:
        return wrapped(*args, **kwargs)
    return _on_device(runtime, params, wrapped(*args, **kwargs))


def install(settings: Settings, target: str) -> None:
    module = sys.modules[target]
    current = getattr(module, _ATTR, None)
    # Absent before TRL had a fused head. chunked_divergence binds it by name at import: when
    # trl.trainer.utils was patched first, that binding is the wrapper already (and stays after
    # disable(), where it falls through to TRL's function: no runtime manages any param).
    if current is not None and not isinstance(current, wrapt.FunctionWrapper):
        _registry.wrap(module, _ATTR, _gather_wrapper, __name__)


def uninstall() -> None:
    _registry.restore_group(__name__)
