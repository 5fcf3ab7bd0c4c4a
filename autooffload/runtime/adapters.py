"""PEFT adapter parameters of a model, found by duck typing (PEFT itself is not imported)."""

from __future__ import annotations

from torch import nn


def adapter_params(model: nn.Module) -> list[nn.Parameter]:
    """Params of every adapter of PEFT tuner layers and of ``modules_to_save`` copies, active or
    not: ``set_adapter`` can make any of them trainable after attach."""
    found: list[nn.Parameter] = []
    for module in model.modules():
        names = getattr(module, "adapter_layer_names", None)  # peft's BaseTunerLayer
        if isinstance(names, tuple | list):
            for name in names:
                container = getattr(module, name, None)
                if isinstance(container, nn.Module):
                    found.extend(container.parameters())
        copies = getattr(module, "modules_to_save", None)  # peft's ModulesToSaveWrapper
        if isinstance(copies, nn.ModuleDict) and hasattr(module, "original_module"):
            found.extend(copies.parameters())
    return list(dict.fromkeys(found))
