"""Quantized (bitsandbytes) parameters: the companion tensors that travel in their chunk.

A bitsandbytes ``Params4bit`` holds packed 4-bit codes; dequantizing them needs its
``quant_state``: ``absmax`` (per block scales), ``code`` (the nf4/fp4 table), and with double
quantization (``compress_statistics``) ``offset`` plus a nested state whose ``absmax`` and
``code`` quantize the scales. An ``Int8Params`` holds int8 rows whose scales ``SCB`` live on the
param or, after the first forward, on its ``Linear8bitLt``'s ``state`` (with ``CB``, an alias
of the weight's bytes). The runtime lays each companion into the chunk right after its param and
points its ``.data`` at the chunk's bytes, exactly like a parameter: it is freed and refilled
with its chunk, and a gather needs no re-pointing (the tensor objects keep their identity).

Found by duck typing (bitsandbytes is not imported). Companions shared between params (a
``code`` table cached by bitsandbytes for every state) are replaced by private copies at attach,
so releasing one chunk cannot free a tensor another chunk or bitsandbytes reads; detach puts
the shared originals back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

# Tensor attributes of a bitsandbytes QuantState (and of its nested ``state2``).
_QUANT_STATE_TENSORS = ("absmax", "code", "offset")
# Attributes that may hold one tensor shared by many params (bitsandbytes' code-table cache).
_SHARED_ATTRS = ("code",)


@dataclass(eq=False)
class Companion:
    """One tensor of a quantized param's state, stored in the param's chunk."""

    name: str  # relative to the param: ``quant_state.absmax``, ``state.SCB``
    owner: object
    attr: str
    tensor: torch.Tensor
    # The shared tensor this private copy replaced at attach (put back on detach), if any.
    original: torch.Tensor | None = None


@dataclass(eq=False)
class QuantizedParams:
    """The companions of every quantized param of one attached model."""

    companions: dict[int, list[Companion]] = field(default_factory=dict)
    # (owner, attr) pairs whose tensor aliases the param's bytes (int8 ``CB``), per param id.
    aliases: dict[int, list[tuple[object, str]]] = field(default_factory=dict)
    # Linear4bit modules whose CPU-only repacking of the weight was switched off while attached.
    repack_off: list[nn.Module] = field(default_factory=list)

    @classmethod
    def collect(cls, modules: Iterable[nn.Module]) -> QuantizedParams:
        """Find the quantized params of ``modules`` and give every shared companion tensor a
        private copy."""
        found = cls()
        seen: set[int] = set()
        for module in modules:
            for name, param in module._parameters.items():
                if param is None or id(param) in found.companions:
                    continue
                entries = _companions_of(module, name, param)
                if not entries:
                    continue
                companions = []
                for suffix, owner, attr in entries:
                    tensor = getattr(owner, attr)
                    original = None
                    if id(tensor) in seen or attr in _SHARED_ATTRS:
                        original, tensor = tensor, tensor.detach().clone()
                        setattr(owner, attr, tensor)
                    seen.add(id(tensor))
                    companions.append(Companion(suffix, owner, attr, tensor, original))
                found.companions[id(param)] = companions
                found.aliases[id(param)] = _aliases_of(module, param)
                if getattr(module, "support_avx512bf16_for_cpu", False):
                    # bitsandbytes repacks an eval-mode CPU weight into a new tensor, which
                    # would leave the chunk: keep the portable layout while attached.
                    module.support_avx512bf16_for_cpu = False
                    found.repack_off.append(module)
        return found

    def named(self) -> dict[int, list[tuple[str, torch.Tensor]]]:
        """Param id -> its companions by name (``build_layout`` lays them after the param)."""
        return {
            pid: [(c.name, c.tensor) for c in companions]
            for pid, companions in self.companions.items()
        }

    def of(self, param: torch.Tensor) -> list[torch.Tensor]:
        """The companion tensors of ``param`` (empty for an ordinary param)."""
        return [c.tensor for c in self.companions.get(id(param), ())]

    @property
    def nbytes(self) -> int:
        """Bytes of every companion tensor."""
        return sum(
            c.tensor.numel() * c.tensor.element_size()
            for companions in self.companions.values()
            for c in companions
        )

    def bind_aliases(self, params: Iterable[nn.Parameter]) -> None:
        """Point every alias (int8 ``CB``) at its param's current bytes (after attach/detach)."""
        for param in params:
            for owner, attr in self.aliases.get(id(param), ()):
                alias = getattr(owner, attr, None)
                if isinstance(alias, torch.Tensor) and alias is not param:
                    alias.data = param.data

    def restore(self, device: torch.device) -> None:
        """Detach: shared originals back where their private copies were (bytes unchanged)."""
        for companions in self.companions.values():
            for companion in companions:
                original = companion.original
                if original is not None and original.device == device:
                    setattr(companion.owner, companion.attr, original)
        for module in self.repack_off:
            module.support_avx512bf16_for_cpu = True


def _companions_of(
    module: nn.Module, name: str, param: nn.Parameter
) -> list[tuple[str, object, str]]:
    """(state-dict-like suffix, owner object, attribute) of each companion tensor of ``param``."""
    entries: list[tuple[str, object, str]] = []
    quant_state = getattr(param, "__dict__", {}).get("quant_state")
    if quant_state is not None and isinstance(getattr(quant_state, "absmax", None), torch.Tensor):
        for attr in _QUANT_STATE_TENSORS:
            if isinstance(getattr(quant_state, attr, None), torch.Tensor):
                entries.append((f"quant_state.{attr}", quant_state, attr))
        nested = getattr(quant_state, "state2", None)
        if nested is not None:
            for attr in _QUANT_STATE_TENSORS:
                if isinstance(getattr(nested, attr, None), torch.Tensor):
                    entries.append((f"quant_state.state2.{attr}", nested, attr))
        return entries
    if param.dtype == torch.int8 and hasattr(param, "SCB"):
        for owner, label in ((param, "weight"), (getattr(module, "state", None), "state")):
            if owner is not None and isinstance(getattr(owner, "SCB", None), torch.Tensor):
                entries.append((f"{label}.SCB", owner, "SCB"))
    return entries


def _aliases_of(module: nn.Module, param: nn.Parameter) -> list[tuple[object, str]]:
    """Where bitsandbytes keeps the int8 weight's bytes under another name (``CB``)."""
    if param.dtype != torch.int8:
        return []
    owners = [param, getattr(module, "state", None)]
    return [(o, "CB") for o in owners if o is not None and hasattr(o, "CB")]
