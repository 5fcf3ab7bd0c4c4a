"""transformers patch: ``from_pretrained`` onto the GPU loads to the host and attaches.

With a single-device ``device_map`` accelerate would materialise every weight on the GPU while
loading, so a model larger than the GPU fails before training starts. When offload is on, the
model is loaded on the host instead and then moved with ``.to(device)``, which attaches it if it
is large and trainable (and is a plain move otherwise). Where it loads is decided from the
``device_map`` the caller passed and the quantizer transformers picked
(``modeling_utils.get_hf_quantizer``, which every ``from_pretrained`` calls):

* a map onto one device of the attach type (``"cuda"``, ``0``, ``{"": 0}``), or a placement
  strategy (``"auto"``, ``"balanced"``, ``"sequential"``, ...) with only one such device to place
  on (one visible GPU: TRL's ``SFTTrainer(model="...")`` loads with ``"auto"``): load on the
  host, attach on that device;
* a bitsandbytes 4-bit or 8-bit load (``quantization_config=BitsAndBytesConfig(...)``, or a
  checkpoint saved quantized) with no map or such a map: transformers would quantize straight
  onto the GPU, so the quantized model, which often does not fit it either, would be there
  before anything could attach it. It is loaded on the host instead, each weight quantized
  on that device by bitsandbytes' own kernels and its codes and quant state brought back
  (``patches/bnb.py``: the bytes of the plain load, one weight on the GPU at a time), and the
  model is attached on that device;
  ``prepare_model_for_kbit_training`` on it is handled by ``patches/peft_lora.py``;
* anything else (several devices, another quantization method, no map for an unquantized
  model) is left to transformers and accelerate: a dispatched model gets no weight offload.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from autooffload.log import logger
from autooffload.optional import import_bitsandbytes
from autooffload.patches import _registry
from autooffload.patches.torch_module import attach_device_type
from autooffload.settings import Settings, current

TARGETS = ("transformers.modeling_utils",)

# accelerate's placement strategies: with one device to place on, each puts the whole model
# there (spilling what does not fit to the CPU, which is what attaching does better).
STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


@dataclass
class _Load:
    """One ``from_pretrained`` call under offload: the caller's map, and where to attach."""

    device_map: Any
    attach_type: str
    target: torch.device | None = None


_loading: ContextVar[_Load | None] = ContextVar("autooffload_loading", default=None)
# Whether transformers has the quantizer step the decision hooks into (older ones do not).
_hooked = {"get_hf_quantizer": False}


def loading_target() -> torch.device | None:
    """The device the ``from_pretrained`` running now attaches on, once decided (else None)."""
    load = _loading.get()
    return None if load is None else load.target


def single_device(device_map: Any) -> torch.device | None:
    """The one device a ``device_map`` puts the whole model on, or None for any other map."""
    if isinstance(device_map, dict):
        if set(device_map) != {""}:
            return None
        device_map = device_map[""]
    if isinstance(device_map, int) and not isinstance(device_map, bool):
        return torch.device("cuda", device_map)
    if isinstance(device_map, (str, torch.device)) and str(device_map) not in (
        *STRATEGIES,
        "disk",
    ):
        try:
            return torch.device(device_map)
        except RuntimeError:
            return None
    return None


def placement_device(device_map: Any, attach_type: str) -> torch.device | None:
    """The device of the attach type that ``device_map`` puts the whole model on, or None: a
    single-device map, or a placement strategy with one such device visible."""
    if isinstance(device_map, str) and device_map in STRATEGIES:
        if attach_type == "cpu":
            return torch.device("cpu")
        if attach_type == "cuda" and torch.cuda.device_count() == 1:
            return torch.device("cuda", 0)
        return None
    device = single_device(device_map)
    return device if device is not None and device.type == attach_type else None


def _is_bitsandbytes_config(config: Any) -> bool:
    method = getattr(config, "quant_method", None)
    if isinstance(config, dict):
        method = config.get("quant_method")
    return str(getattr(method, "value", method)) == "bitsandbytes"


def _is_bitsandbytes(hf_quantizer: Any) -> bool:
    return _is_bitsandbytes_config(getattr(hf_quantizer, "quantization_config", None))


def _get_hf_quantizer_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    # (hf_quantizer, config, ..., device_map) in every transformers that has it.
    result = wrapped(*args, **kwargs)
    load = _loading.get()
    if load is None or load.target is not None:
        return result
    hf_quantizer, device_map = result[0], result[-1]
    if hf_quantizer is None:
        target = placement_device(load.device_map, load.attach_type)
        host_map = None
    elif _is_bitsandbytes(hf_quantizer):
        # No map: the one the quantizer chose (the current GPU).
        requested = device_map if load.device_map is None else load.device_map
        target = placement_device(requested, load.attach_type)
        host_map = {"": "cpu"}
    else:
        return result
    if target is None:
        return result
    load.target = target
    logger.debug(
        "from_pretrained(device_map=%r%s): loading on the host, then attaching on %s",
        load.device_map,
        ", bitsandbytes" if host_map else "",
        target,
    )
    return (*result[:-1], host_map)


def _from_pretrained_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    settings = current()
    if settings is None or not settings.offload:
        return wrapped(*args, **kwargs)
    if _is_bitsandbytes_config(kwargs.get("quantization_config")):
        import_bitsandbytes()  # the extra's error if missing; its import notice silenced
    load = _Load(kwargs.get("device_map"), attach_device_type(settings))
    if not _hooked["get_hf_quantizer"]:
        # A transformers without the quantizer step to hook: single-device maps only.
        load.target = placement_device(load.device_map, load.attach_type)
        if load.target is not None:
            kwargs = {k: v for k, v in kwargs.items() if k != "device_map"}
    token = _loading.set(load)
    try:
        model = wrapped(*args, **kwargs)
    finally:
        _loading.reset(token)
    if load.target is None:
        return model
    # The host map was ours: the model is placed by the move, as if loaded without a map.
    if isinstance(getattr(model, "hf_device_map", None), dict):
        del model.hf_device_map
    return model.to(load.target)


def install(settings: Settings, target: str) -> None:
    from transformers import modeling_utils
    from transformers.modeling_utils import PreTrainedModel

    _registry.wrap(PreTrainedModel, "from_pretrained", _from_pretrained_wrapper, __name__)
    if hasattr(modeling_utils, "get_hf_quantizer"):
        _registry.wrap(modeling_utils, "get_hf_quantizer", _get_hf_quantizer_wrapper, __name__)
        _hooked["get_hf_quantizer"] = True


def uninstall() -> None:
    _registry.restore_group(__name__)
    _hooked["get_hf_quantizer"] = False
