"""bitsandbytes patches: state dicts of attached quantized layers read their quant state with
the layer's chunk on the device, and hand out host copies of what lives in an offloaded chunk.

A ``Params4bit``'s quant state (absmax, offset, nested absmax, code tables) and an int8
weight's ``SCB`` live in the weight's chunk (``runtime/quantized.py``): their storage is empty
while the chunk is on the host. ``Linear4bit._save_to_state_dict`` reads them (``as_dict`` even
calls ``offset.item()``), so the chunk is gathered and held for the call, and the tensors it put
in the state dict are copied to the CPU, as the runtime does for offloaded params.
"""

from __future__ import annotations

from typing import Any

import torch

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


def install(settings: Settings, target: str) -> None:
    import bitsandbytes as bnb

    for cls in (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt):
        if "_save_to_state_dict" in cls.__dict__:
            _registry.wrap(cls, "_save_to_state_dict", _save_to_state_dict_wrapper, __name__)


def uninstall() -> None:
    _registry.restore_group(__name__)
