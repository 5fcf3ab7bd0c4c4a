"""HF Trainer and accelerate checkpoints of sharded runs: consolidate on every rank first.

With the CPU optimizer state sharded across data-parallel ranks (``runtime/parallel/sharding.py``),
writing a checkpoint needs one collective on every rank before the saving rank reads the
weights and the optimizer state. ``Trainer._save_checkpoint`` runs on every rank and saves the
optimizer on rank 0 only: it consolidates to rank 0. ``Accelerator.save_state`` asks every
rank for ``optimizer.state_dict()`` (and writes on the main one): it consolidates to all.
``Accelerator.load_state`` reads ``model.state_dict()`` for its names and shapes only (in
safetensors' ``load_model``): chunks the rank does not hold are uninitialised placeholders there.
"""

from __future__ import annotations

import sys
from typing import Any

from autooffload.patches import _registry
from autooffload.settings import Settings

TARGETS = ("transformers.trainer", "accelerate.accelerator")


def _consolidate(models: list[Any], to: int | None) -> None:
    import autooffload

    for model in models:
        if model is not None:
            autooffload.consolidate(model, to=to)


def _trainer_save_checkpoint(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    _consolidate([getattr(instance, "model", None)], to=0)
    return wrapped(*args, **kwargs)


def _accelerator_save_state(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    _consolidate(list(getattr(instance, "_models", [])), to=None)
    return wrapped(*args, **kwargs)


def _accelerator_load_state(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    from autooffload import runtime as rt
    from autooffload.runtime.parallel.sharding import shapes_only

    runtimes = [r for m in getattr(instance, "_models", []) for r in rt.runtimes_in(m)]
    with shapes_only(runtimes):
        return wrapped(*args, **kwargs)


def install(settings: Settings, target: str) -> None:
    # The module itself: its package may still be initialising (a post-import hook).
    module = sys.modules[target]
    if target == "transformers.trainer":
        _registry.wrap(module.Trainer, "_save_checkpoint", _trainer_save_checkpoint, __name__)
    else:
        _registry.wrap(module.Accelerator, "save_state", _accelerator_save_state, __name__)
        _registry.wrap(module.Accelerator, "load_state", _accelerator_load_state, __name__)


def uninstall() -> None:
    _registry.restore_group(__name__)
