"""transformers patch: ``from_pretrained(..., device_map="cuda")`` loads to the host and attaches.

With a single-device ``device_map`` accelerate would materialise every weight on the GPU while
loading, so a model larger than the GPU fails before training starts. When offload is on, the
model is loaded on the host instead and then moved with ``.to(device)``, which attaches it if it
is large and trainable (and is a plain move otherwise). ``device_map="auto"`` or a multi-device
map is left to accelerate: a dispatched model gets no weight offload.
"""

from __future__ import annotations

from typing import Any

import torch

from autooffload.log import logger
from autooffload.patches import _registry
from autooffload.patches.torch_module import attach_device_type
from autooffload.settings import Settings, current

TARGETS = ("transformers.modeling_utils",)


def single_device(device_map: Any) -> torch.device | None:
    """The one device a ``device_map`` puts the whole model on, or None for any other map."""
    if isinstance(device_map, dict):
        if set(device_map) != {""}:
            return None
        device_map = device_map[""]
    if isinstance(device_map, int) and not isinstance(device_map, bool):
        return torch.device("cuda", device_map)
    if isinstance(device_map, (str, torch.device)) and str(device_map) not in ("auto", "disk"):
        try:
            return torch.device(device_map)
        except RuntimeError:
            return None
    return None


def _from_pretrained_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    settings = current()
    device = single_device(kwargs.get("device_map"))
    if settings is None or not settings.offload or device is None:
        return wrapped(*args, **kwargs)
    if device.type != attach_device_type(settings):
        return wrapped(*args, **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k != "device_map"}
    logger.debug("from_pretrained(device_map=%s): loading on the host, then attaching", device)
    model = wrapped(*args, **kwargs)
    return model.to(device)


def install(settings: Settings, target: str) -> None:
    from transformers.modeling_utils import PreTrainedModel

    _registry.wrap(PreTrainedModel, "from_pretrained", _from_pretrained_wrapper, __name__)


def uninstall() -> None:
    _registry.restore_group(__name__)
