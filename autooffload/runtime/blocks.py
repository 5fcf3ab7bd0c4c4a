"""Find the execution groups of a model: its repeated blocks, and the modules around them."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn


@dataclass(eq=False)
class Group:
    """A module whose parameters are gathered together: a repeated block or a non-block module.

    ``index`` is the group's position in the static order (registration order, which is the
    execution order for HF decoder models); the runtime refines it with the order it observes.
    """

    index: int
    name: str
    module: nn.Module
    is_block: bool
    block_index: int | None = None

    def params(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The group's own parameters, each once, by qualified name: a block's recursively, a
        non-block module's direct ones (its children are groups of their own)."""
        seen: set[int] = set()
        named = self.module.named_parameters(recurse=self.is_block, remove_duplicate=False)
        for name, param in named:
            if id(param) not in seen:
                seen.add(id(param))
                yield f"{self.name}.{name}", param


def _hf_layer_class() -> type | None:
    """transformers' ``GradientCheckpointingLayer`` (the base of its decoder and encoder layers),
    when transformers is already imported; None otherwise (never imports it)."""
    module = sys.modules.get("transformers.modeling_layers")
    return getattr(module, "GradientCheckpointingLayer", None)


def _is_block_list(module_list: nn.ModuleList, hf_layer: type | None) -> bool:
    """Same-class modules, or HF layers of several classes (Llama-3.2-Vision interleaves
    self- and cross-attention decoder layers in one list)."""
    if len({type(m) for m in module_list}) == 1:
        return True
    return hf_layer is not None and all(isinstance(m, hf_layer) for m in module_list)


def _block_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """ModuleLists of >= 2 modules holding parameters, all of one class or all HF layers
    (HF ``layers``, ``blocks``)."""
    hf_layer = _hf_layer_class()
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if not _is_block_list(module, hf_layer):
            continue
        if sum(p.numel() for p in module.parameters()) == 0:
            continue
        found.append((name, module))
    # A block list nested inside another block list's block is not a block list of the model.
    outer = [
        (name, ml)
        for name, ml in found
        if not any(name != other and name.startswith(other + ".") for other, _ in found)
    ]
    return outer


def discover_groups(model: nn.Module) -> list[Group]:
    """Split ``model`` into groups in registration order.

    Every block of every block list is a group; every other module that directly owns
    parameters (embeddings, final norm, head, a vision merger...) is a group of its own.
    Parameters registered directly on a module that also contains blocks are grouped on that
    module, which stays resident (see ``Group.is_block``).
    """
    block_of: dict[int, tuple[str, int]] = {}
    for list_name, module_list in _block_lists(model):
        for i, block in enumerate(module_list):
            block_of[id(block)] = (f"{list_name}.{i}" if list_name else str(i), i)

    groups: list[Group] = []
    inside_block: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in inside_block:
            continue
        if id(module) in block_of:
            block_name, block_index = block_of[id(module)]
            groups.append(Group(len(groups), block_name, module, True, block_index))
            inside_block.update(id(m) for m in module.modules())
            continue
        if any(True for _ in module.parameters(recurse=False)):
            groups.append(Group(len(groups), name or "<root>", module, False))
    return groups
