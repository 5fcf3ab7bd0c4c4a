"""The CPU twins' optimizer classes and hyperparameters: which torch optimizers have a CPU twin,
and a twin group's hyperparameters as copied from the user's group at every step."""

from __future__ import annotations

import torch

from autooffload.errors import AttachError

# torch.optim classes that run on CPU tensors; the fused CPU kernels are the fast path.
CPU_OPTIMIZERS = ("Adam", "AdamW", "SGD", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam")
FUSED_ON_CPU = ("Adam", "AdamW", "SGD", "Adagrad")


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
        f" parameters{hint}; use one of torch.optim.{{{', '.join(CPU_OPTIMIZERS)}}}, or keep every"
        " trainable parameter on the GPU (AUTOOFFLOAD_OFFLOAD=0, or a larger AUTOOFFLOAD_N_PERSIST)"
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
