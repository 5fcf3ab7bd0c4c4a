"""bitsandbytes patches: state dicts of attached quantized layers read their quant state with
the layer's chunk on the device, and hand out host copies of what lives in an offloaded chunk.

A ``Params4bit``'s quant state (absmax, offset, nested absmax, code tables) and an int8
weight's ``SCB`` live in the weight's chunk (``runtime/quantized.py``): their storage is empty
while the chunk is on the host. ``Linear4bit._save_to_state_dict`` reads them (``as_dict`` even
calls ``offset.item()``), so the chunk is gathered and held for the call, and the tensors it put
in the state dict are copied to the CPU, as the runtime does for offloaded params.

A quantized ``from_pretrained`` that loads on the host for an attach on a GPU quantizes each
weight on that GPU and brings it back (``_quantize_wrapper``), so the attached model holds the
bytes the plain load would have put on the GPU.
"""

from __future__ import annotations

from typing import Any

import torch

from autooffload.optional import import_bitsandbytes
from autooffload.patches import _registry
from autooffload.settings import Settings

TARGETS = ("bitsandbytes",)


def _destination_and_prefix(destination: dict, prefix: str, *rest: Any, **kwargs: Any):
    return destination, prefix


def _save_to_state_dict_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    from autooffload.runtime.access import params_on_device, runtime_managing

    params = list(instance.parameters(recurse=False))
    runtime = runtime_managing(params)
    if runtime is None:
        return wrapped(*args, **kwargs)
    destination, prefix = _destination_and_prefix(*args, **kwargs)
    before = set(destination)
    companions = [t for p in params for t in runtime.quantized.of(p)]
    offloaded = any(runtime.is_offloaded(p) for p in params)
    own = {prefix + name for name in instance._parameters}
    with params_on_device(runtime, params + companions):
        result = wrapped(*args, **kwargs)
        if offloaded:
            # Params are the runtime's state-dict hooks' business; the rest is quant state
            # read from the chunk, whose device storage is freed when this block ends.
            for key in set(destination) - before - own:
                value = destination[key]
                if isinstance(value, torch.Tensor) and value.device.type != "meta":
                    destination[key] = value.detach().to("cpu", copy=True)
    return result


def _quantize_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``Params4bit._quantize`` / ``Int8Params._quantize`` while ``from_pretrained`` loads a
    model on the host for an attach on a GPU (``patches/transformers_loading.py``): quantize on
    that GPU, as the plain load would (bitsandbytes' CPU kernels round the double-quantized
    scales differently), then bring the codes and quant state to the host."""
    from autooffload.patches.transformers_loading import loading_target

    target = loading_target()
    device = torch.device(args[0] if args else kwargs["device"])
    if (
        target is None
        or target.type == "cpu"
        or device.type != "cpu"
        or getattr(instance, "has_fp16_weights", False)  # an Int8Params kept unquantized
    ):
        return wrapped(*args, **kwargs)
    result = wrapped(target)
    result.data = result.data.to(device)
    quant_state = getattr(result, "quant_state", None)
    if quant_state is not None:
        quant_state.to(device)  # in place: the module's quant_state is this object
    if getattr(result, "SCB", None) is not None:
        result.CB = result.data
        result.SCB = result.SCB.to(device)
    return result


def install(settings: Settings, target: str) -> None:
    bnb = import_bitsandbytes()

    for param_cls in (bnb.nn.Params4bit, bnb.nn.Int8Params):
        if "_quantize" in param_cls.__dict__:
            _registry.wrap(param_cls, "_quantize", _quantize_wrapper, __name__)

    for cls in (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt):
        if "_save_to_state_dict" in cls.__dict__:
            _registry.wrap(cls, "_save_to_state_dict", _save_to_state_dict_wrapper, __name__)


def uninstall() -> None:
    _registry.restore_group(__name__)
