"""The CPU twins of the user's optimizers: which torch optimizers have one, a twin group's
hyperparameters as copied from the user's group at every step, and the twins of each chunk.

Several bound optimizers may hold the same parameter (a script that builds a second optimizer
over the model and keeps stepping the first, or alternates): as in plain PyTorch, each steps it
with its own state, here its own twin over the shared master. Bound optimizers are held weakly:
one the script no longer references is forgotten with its twins' state at the next bind or step
(``prune``), as plain PyTorch frees its state with it.
"""

from __future__ import annotations

import inspect
import weakref

import torch

from autooffload.errors import AttachError
from autooffload.runtime.chunks.layout import Chunk

# torch.optim classes that run on CPU tensors; the fused CPU kernels are the fast path.
CPU_OPTIMIZERS = ("Adam", "AdamW", "SGD", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam")
FUSED_ON_CPU = ("Adam", "AdamW", "SGD", "Adagrad")
# TrainingArguments.optim values that build one of them.
TRAINER_OPTIMS = ("adamw_torch_fused", "adamw_torch", "sgd", "adagrad", "rmsprop")


def check_optimizer_class(optimizer: torch.optim.Optimizer) -> None:
    """Raise ``AttachError`` if the optimizer's class has no CPU twin."""
    cls = type(optimizer)
    if cls.__module__.startswith("torch.optim") and cls.__name__ in CPU_OPTIMIZERS:
        return
    hint = ""
    if cls.__module__.startswith("bitsandbytes"):
        # bnb optimizers (8-bit, paged) keep their state on the GPU: they fit resident params
        # (LoRA adapters under a tenth of the model's bytes), not chunks updated on the CPU.
        hint = " (bitsandbytes optimizers update only params that stay on the GPU)"
    raise AttachError(
        f"optimizer class {cls.__module__}.{cls.__name__} has no CPU path for offloaded"
        f" parameters{hint}; use one of torch.optim.{{{', '.join(CPU_OPTIMIZERS)}}} (HF Trainer:"
        f" optim={', '.join(TRAINER_OPTIMS[:-1])} or {TRAINER_OPTIMS[-1]}), or keep every"
        " trainable parameter on the GPU (AUTOOFFLOAD_OFFLOAD=0, or a larger"
        " AUTOOFFLOAD_N_PERSIST)"
    )


def twin_group(group: dict, cls: type) -> dict:
    """A twin's hyperparameters from the user's param ``group`` of optimizer class ``cls``:
    tensors of one element as numbers, the CPU kernels' flags set."""
    hyper = {k: v for k, v in group.items() if k != "params"}
    for key, value in list(hyper.items()):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            hyper[key] = value.item()
    hyper["foreach"] = False
    hyper["capturable"] = False
    hyper["differentiable"] = False
    hyper["fused"] = cls.__name__ in FUSED_ON_CPU or None
    return hyper


class Twins:
    """The CPU twins of the bound optimizers, one per chunk and optimizer, over the chunk's
    masters; and which bound optimizers, and which of their param groups, hold each param."""

    def __init__(self, masters: dict[int, torch.Tensor]) -> None:
        # The CPU optimizer's masters by param id (read here: a twin's params are masters).
        self._masters = masters
        # The bound optimizers by id, in binding order, held weakly (``prune``).
        self._bound: dict[int, weakref.ref[torch.optim.Optimizer]] = {}
        # Per bound optimizer's id: the ids of its params and the index of the group of each.
        self._groups: dict[int, dict[int, int]] = {}
        # Per bound optimizer's id: its place in the binding order, the same on every rank of a
        # data-parallel run (names an optimizer's state in collectives: ``serial_of``).
        self._serials: dict[int, int] = {}
        self._next_serial = 0
        # Twins and their user-group indices, keyed by (chunk index, id(user optimizer)).
        self._twins: dict[tuple[int, int], torch.optim.Optimizer] = {}
        self._group_index: dict[tuple[int, int], list[int]] = {}

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer`` holds its params from now on (beside any other bound optimizer holding
        some of them); its twins are built anew on next use."""
        self.prune()  # before the id is reused by this optimizer
        key = id(optimizer)
        if key not in self._bound:
            self._bound[key] = weakref.ref(optimizer)
            self._serials[key] = self._next_serial
            self._next_serial += 1
        self._groups[key] = {
            id(param): g
            for g, group in enumerate(optimizer.param_groups)
            for param in group["params"]
        }
        self._drop_twins(key)

    def prune(self) -> None:
        """Forget every bound optimizer that no longer exists, and its twins' state."""
        for key in [k for k, ref in self._bound.items() if ref() is None]:
            del self._bound[key]
            del self._groups[key]
            del self._serials[key]
            self._drop_twins(key)

    def _drop_twins(self, key: int) -> None:
        for twin_key in [k for k in self._twins if k[1] == key]:
            del self._twins[twin_key]
            del self._group_index[twin_key]

    def _params(self, optimizer: torch.optim.Optimizer) -> dict[int, int] | None:
        """``optimizer``'s param ids and group indices if it is bound (None otherwise: an id
        alone could be a dead optimizer's that ``prune`` has not seen yet)."""
        ref = self._bound.get(id(optimizer))
        if ref is None or ref() is not optimizer:
            return None
        return self._groups[id(optimizer)]

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The bound optimizers that still exist, in binding order."""
        return [o for ref in self._bound.values() if (o := ref()) is not None]

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The first bound optimizer (most scripts have exactly one)."""
        optimizers = self.optimizers
        return optimizers[0] if optimizers else None

    def params_of(self, optimizer: torch.optim.Optimizer) -> set[int]:
        """The ids of the params ``optimizer`` holds (none if it is not bound)."""
        return set(self._params(optimizer) or ())

    def group_of(self, optimizer: torch.optim.Optimizer, pid: int) -> int:
        """The index of ``optimizer``'s param group holding param ``pid``."""
        return self._groups[id(optimizer)][pid]

    def owners(self, pid: int) -> list[torch.optim.Optimizer]:
        """Every bound optimizer holding param ``pid``, in binding order."""
        return [o for o in self.optimizers if pid in self._groups[id(o)]]

    def serial_of(self, optimizer: torch.optim.Optimizer) -> int:
        """``optimizer``'s place in the binding order (bound optimizers only)."""
        return self._serials[id(optimizer)]

    def of_serial(self, serial: int) -> torch.optim.Optimizer | None:
        """The bound optimizer at ``serial`` in the binding order, if it still exists."""
        for key, value in self._serials.items():
            if value == serial:
                return self._bound[key]()
        return None

    def get(self, index: int, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
        """The twin of ``optimizer`` over chunk ``index`` if it was built."""
        if self._params(optimizer) is None:
            return None
        return self._twins.get((index, id(optimizer)))

    def twin(self, chunk: Chunk, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
        """The twin of ``optimizer`` over ``chunk``'s masters it owns (built on first use); None
        where it owns none of them."""
        params = self._params(optimizer)
        if params is None:
            return None
        key = (chunk.index, id(optimizer))
        twin = self._twins.get(key)
        if twin is not None:
            return twin
        by_group: dict[int, list[torch.Tensor]] = {}
        # Every param with a master, frozen ones too: one frozen now and unfrozen later must
        # still be updated (torch optimizers skip params without a gradient).
        for slot in chunk.slots:
            pid = id(slot.param)
            if pid in params and pid in self._masters:
                by_group.setdefault(params[pid], []).append(self._masters[pid])
        if not by_group:
            return None
        cls = type(optimizer)
        groups = [
            {"params": params, **twin_group(optimizer.param_groups[g], cls)}
            for g, params in by_group.items()
        ]
        kwargs = {}
        if "fused" in inspect.signature(cls.__init__).parameters and cls.__name__ in FUSED_ON_CPU:
            kwargs["fused"] = True
        twin = cls(groups, **kwargs)
        self._twins[key] = twin
        self._group_index[key] = list(by_group)
        return twin

    def of_chunk(self, chunk: Chunk) -> list[torch.optim.Optimizer]:
        """Every twin built over ``chunk`` (one per optimizer owning part of it)."""
        return [twin for (index, _), twin in self._twins.items() if index == chunk.index]

    def hyper(self, chunk: Chunk, optimizer: torch.optim.Optimizer) -> list[dict]:
        """The user's hyperparameters for ``chunk``'s twin groups (the twin is built), as the
        twin takes them."""
        return [
            twin_group(optimizer.param_groups[g], type(optimizer))
            for g in self._group_index[(chunk.index, id(optimizer))]
        ]

    def sole_owner(self, chunk: Chunk) -> torch.optim.Optimizer | None:
        """The one bound optimizer holding every trainable param of ``chunk``; None when none
        is bound yet, or several hold its params (an update in the backward is then left to
        step())."""
        optimizers = self.optimizers
        owners = set()
        for slot in chunk.trainable_slots:
            held = [o for o in optimizers if id(slot.param) in self._groups[id(o)]]
            if len(held) != 1:
                return None
            owners.add(held[0])
        return owners.pop() if len(owners) == 1 else None

    def shared(self, chunk: Chunk) -> bool:
        """Whether two bound optimizers hold one of ``chunk``'s trainable params."""
        return any(len(self.owners(id(s.param))) > 1 for s in chunk.trainable_slots)

    def release(self, chunk: Chunk) -> dict[int, tuple[torch.optim.Optimizer, dict[int, dict]]]:
        """Drop ``chunk``'s twins (it became persistent); per optimizer id, the optimizer and its
        twin's state per param id."""
        states: dict[int, tuple[torch.optim.Optimizer, dict[int, dict]]] = {}
        for key in [k for k in self._twins if k[0] == chunk.index]:
            twin = self._twins.pop(key)
            self._group_index.pop(key, None)
            optimizer = self._bound[key[1]]()
            if optimizer is None:
                continue  # gone: ``prune`` forgets it
            mine = states.setdefault(key[1], (optimizer, {}))[1]
            for slot in chunk.slots:
                master = self._masters.get(id(slot.param))
                if master is not None and master in twin.state:
                    mine[id(slot.param)] = dict(twin.state[master])
        return states

    def clear(self) -> None:
        """Detach: forget every optimizer and twin (their state holds host tensors)."""
        self._twins.clear()
        self._group_index.clear()
        self._bound.clear()
        self._groups.clear()
        self._serials.clear()
