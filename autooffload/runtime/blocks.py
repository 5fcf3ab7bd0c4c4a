"""Find the execution groups of a model: its repeated blocks, and the modules around them."""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
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
    # Children of a non-block module whose weights its own code reads without calling them
    # (DeBERTa's encoder reads ``self.rel_embeddings.weight``): their params are this group's.
    adopted: tuple[str, ...] = ()

    def params(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The group's own parameters, each once, by qualified name: a block's recursively, a
        non-block module's direct ones and its adopted children's (its other children are
        groups of their own)."""
        seen: set[int] = set()
        named = list(self.module.named_parameters(recurse=self.is_block, remove_duplicate=False))
        for child in self.adopted:
            module = self.module.get_submodule(child)
            named += [(f"{child}.{n}", p) for n, p in module.named_parameters(recurse=False)]
        for name, param in named:
            if id(param) not in seen:
                seen.add(id(param))
                yield f"{self.name}.{name}", param


# Attributes of a weight that read no data: ``self.proj.weight.dtype`` needs no gather.
_METADATA = frozenset({"dtype", "device", "shape", "size", "ndim", "dim", "numel", "requires_grad"})


def _read_not_called(cls: type) -> frozenset[str]:
    """Attributes ``c`` for which the code of ``cls`` reads ``self.c.weight`` or ``self.c.bias``
    as data, and never calls ``self.c(...)``: a child module used only through its weights,
    whose own forward never runs. The code read is that of ``cls`` and its bases that define a
    ``forward`` (module implementations, not library mixins), outside torch."""
    read: set[str] = set()
    called: set[str] = set()
    for klass in cls.__mro__:
        if "forward" in vars(klass) and not klass.__module__.startswith("torch."):
            klass_read, klass_called = _self_uses(klass)
            read |= klass_read
            called |= klass_called
    return frozenset(read - called)


@functools.cache
def _self_uses(klass: type) -> tuple[frozenset[str], frozenset[str]]:
    """The children whose weights the methods ``klass`` defines read, and those they call."""
    read: set[str] = set()
    called: set[str] = set()
    for tree in _method_trees(klass):
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and _is_self(node.func.value)
            ):
                called.add(node.func.attr)
            read.update(_weight_reads(node))
    return frozenset(read), frozenset(called)


def _method_trees(klass: type) -> Iterator[ast.Module]:
    """The parsed source of each method ``klass`` defines (each method's own lines)."""
    for value in vars(klass).values():
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        elif isinstance(value, property):
            value = value.fget
        if not inspect.isfunction(value):
            continue
        try:
            yield ast.parse(textwrap.dedent(inspect.getsource(value)))
        except (OSError, TypeError, SyntaxError):
            continue


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _weight_reads(node: ast.AST) -> Iterator[str]:
    """``c`` for each data read of ``self.c.weight`` or ``self.c.bias`` directly under
    ``node`` (not followed by one of ``_METADATA``, not assigned to)."""
    for child in ast.iter_child_nodes(node):
        if not (
            isinstance(child, ast.Attribute)
            and child.attr in ("weight", "bias")
            and isinstance(child.ctx, ast.Load)
            and isinstance(child.value, ast.Attribute)
            and _is_self(child.value.value)
        ):
            continue
        if isinstance(node, ast.Attribute) and node.attr in _METADATA:
            continue
        yield child.value.attr


def _adopted_children(module: nn.Module, blocks: dict[int, tuple[str, int]]) -> tuple[str, ...]:
    """Children of ``module`` used only through their weights by its code (never called),
    owning params but no param-owning children, and not blocks."""
    adopted = []
    for name in sorted(_read_not_called(type(module))):
        child = module._modules.get(name)
        if child is None or id(child) in blocks:
            continue
        direct = sum(1 for _ in child.parameters(recurse=False))
        if direct and direct == sum(1 for _ in child.parameters()):
            adopted.append(name)
    return tuple(adopted)


def _hf_layer_class() -> type | None:
    """transformers' ``GradientCheckpointingLayer`` (the base of its decoder and encoder layers),
    when transformers is already imported; None otherwise (never imports it)."""
    module = sys.modules.get("transformers.modeling_layers")
    return getattr(module, "GradientCheckpointingLayer", None)


def _is_block_list(module_list: nn.Module, hf_layer: type | None) -> bool:
    """Same-class modules, or HF layers of several classes (Llama-3.2-Vision interleaves
    self- and cross-attention decoder layers in one list)."""
    if len({type(m) for m in module_list}) == 1:
        return True
    return hf_layer is not None and all(isinstance(m, hf_layer) for m in module_list)


def _is_block_container(module: nn.Module, hf_layer: type | None) -> bool:
    """A ModuleList of >= 2 modules, or of one HF layer (a one-layer model); or an
    ``nn.Sequential`` of >= 2 modules that have children of their own (timm's ``blocks``;
    a Sequential of bare layers, ``Linear, Linear``, is a module's own computation)."""
    if isinstance(module, nn.ModuleList):
        if len(module) == 1:
            return hf_layer is not None and isinstance(module[0], hf_layer)
        return len(module) >= 2
    if type(module) is nn.Sequential and len(module) >= 2:
        return all(any(True for _ in child.children()) for child in module)
    return False


def _block_lists(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Containers of blocks holding parameters (``_is_block_container``), all of one class or
    all HF layers (HF ``layers``, ``blocks``)."""
    hf_layer = _hf_layer_class()
    found = []
    for name, module in model.named_modules():
        if not _is_block_container(module, hf_layer):
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
    module, which stays resident (see ``Group.is_block``). A child whose weights its parent's
    code reads without calling it (DeBERTa's relative position embeddings) belongs to the
    parent's group: its own forward never runs, so only the parent's gathers its weights.
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
        adopted = _adopted_children(module, block_of)
        inside_block.update(id(module.get_submodule(child)) for child in adopted)
        if adopted or any(True for _ in module.parameters(recurse=False)):
            groups.append(Group(len(groups), name or "<root>", module, False, adopted=adopted))
    return groups
