"""The CPU twins of the user's optimizers: which torch optimizers have one, a twin group's
hyperparameters as copied from the user's group at every step, and the twins of each chunk."""

from __future__ import annotations

import inspect

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
    masters; and which bound optimizer and param group own each param."""

    def __init__(self, masters: dict[int, torch.Tensor]) -> None:
        # The CPU optimizer's masters by param id (read here: a twin's params are masters).
        self._masters = masters
        self.optimizers: list[torch.optim.Optimizer] = []
        self.optimizer_of_param: dict[int, torch.optim.Optimizer] = {}
        self.group_of_param: dict[int, int] = {}
        # Twins and their user-group indices, keyed by (chunk index, id(user optimizer)).
        self._twins: dict[tuple[int, int], torch.optim.Optimizer] = {}
        self._group_index: dict[tuple[int, int], list[int]] = {}

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer`` owns its params from now on; its twins are built anew on next use."""
        if not any(o is optimizer for o in self.optimizers):
            self.optimizers.append(optimizer)
        for g, group in enumerate(optimizer.param_groups):
            for param in group["params"]:
                self.optimizer_of_param[id(param)] = optimizer
                self.group_of_param[id(param)] = g
        for key in [k for k in self._twins if k[1] == id(optimizer)]:
            del self._twins[key]
            del self._group_index[key]

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The first bound optimizer (most scripts have exactly one)."""
        return self.optimizers[0] if self.optimizers else None

    def get(self, index: int, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
        """The twin of ``optimizer`` over chunk ``index`` if it was built."""
        return self._twins.get((index, id(optimizer)))

    def twin(self, chunk: Chunk, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
        """The twin of ``optimizer`` over ``chunk``'s masters it owns (built on first use); None
        where it owns none of them."""
        key = (chunk.index, id(optimizer))
        twin = self._twins.get(key)
        if twin is not None:
            return twin
        by_group: dict[int, list[torch.Tensor]] = {}
        # Every param with a master, frozen ones too: one frozen now and unfrozen later must
        # still be updated (torch optimizers skip params without a gradient).
        for slot in chunk.slots:
            pid = id(slot.param)
            if self.optimizer_of_param.get(pid) is optimizer and pid in self._masters:
                by_group.setdefault(self.group_of_param[pid], []).append(self._masters[pid])
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
        """The one bound optimizer owning every trainable param of ``chunk``; None when none
        is bound yet or several share it (an update in the backward is then left to step())."""
        owners = {self.optimizer_of_param.get(id(s.param)) for s in chunk.trainable_slots}
        return owners.pop() if len(owners) == 1 else None

    def release(self, chunk: Chunk) -> dict[int, dict]:
        """Drop ``chunk``'s twins (it became persistent); their state per param id."""
        states: dict[int, dict] = {}
        for key in [k for k in self._twins if k[0] == chunk.index]:
            twin = self._twins.pop(key)
            self._group_index.pop(key, None)
            for slot in chunk.slots:
                master = self._masters.get(id(slot.param))
                if master is not None and master in twin.state:
                    states[id(slot.param)] = dict(twin.state[master])
        return states

    def clear(self) -> None:
        """Detach: forget every optimizer and twin (their state holds host tensors)."""
        self._twins.clear()
        self._group_index.clear()
        self.optimizers.clear()
        self.optimizer_of_param.clear()
        self.group_of_param.clear()
