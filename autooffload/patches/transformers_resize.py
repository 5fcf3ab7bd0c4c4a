"""transformers patch: ``resize_token_embeddings`` on an attached model detaches it for the call.

transformers resizes the input embedding (and an untied head) by building a new weight from the
old one's values and mean, then replacing the old parameter's ``.data`` with it: a read of an
offloaded placeholder (a crash) and a layout change no chunk can follow. The model is detached
to the host for the call, resized as transformers resizes it, and attached again on the same
device with the same settings; the plan is searched anew at its next forward. After an optimizer
was built over the model it is refused, as ``prepare_model_for_kbit_training`` is
(``patches/peft_lora.py``): the optimizer holds the parameters whose shape the resize changes.
"""

from __future__ import annotations

from typing import Any

from autooffload.patches import _registry
from autooffload.settings import Settings

TARGETS = ("transformers.modeling_utils",)


def _resize_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    from autooffload.runtime.access import call_detached, runtime_managing

    runtime = runtime_managing(instance.parameters())
    if runtime is None:
        return wrapped(*args, **kwargs)
    return call_detached(
        runtime,
        "resize_token_embeddings on an attached model after an optimizer was built over it"
        " is not supported: it replaces the embedding weights the optimizer holds; resize"
        " before creating the optimizer or the Trainer (or before autooffload.attach)",
        lambda: wrapped(*args, **kwargs),
    )


def install(settings: Settings, target: str) -> None:
    from transformers.modeling_utils import PreTrainedModel

    _registry.wrap(PreTrainedModel, "resize_token_embeddings", _resize_wrapper, __name__)


def uninstall() -> None:
    _registry.restore_group(__name__)
