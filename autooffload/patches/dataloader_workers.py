"""Patches torch's DataLoader so its worker processes mask labels as the main process does.

A worker started with ``spawn`` or ``forkserver`` (the default on macOS and Windows, and on Linux
from Python 3.14) imports every module afresh: the collator it unpickles would run without the
masking patches and train every token. While a DataLoader starts its workers, its
``worker_init_fn`` is a ``WorkerMasking`` that installs the masking patches with this process's
settings and binds the collators to their tokenizers again, before the worker collates anything;
the user's ``worker_init_fn`` runs after it and is put back on the loader once the workers start.
It is pickled with the collate_fn, so the collators it binds are the worker's own. A ``fork``
worker inherits the patches, and the same call finds them in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autooffload import log, patches
from autooffload.patches import _registry, hf_collators
from autooffload.settings import Settings, current

TARGETS: tuple[str, ...] = ("torch.utils.data.dataloader",)

# The patch modules a worker needs: only collators, processors and tokenizers run there.
WORKER_PATCH_MODULES: tuple[str, ...] = ("hf_collators",)


@dataclass(frozen=True)
class WorkerMasking:
    """A DataLoader worker's init function: masking as in the parent, then ``init_fn``."""

    settings: Settings
    carried: hf_collators.CarriedSources
    init_fn: Callable[[int], None] | None

    def __call__(self, worker_id: int) -> None:
        if not patches.is_installed():
            log.configure(self.settings.log)
            patches.install_all(self.settings, WORKER_PATCH_MODULES)
        hf_collators.adopt(self.carried)
        if self.init_fn is not None:
            self.init_fn(worker_id)


def install(settings: Settings, target: str) -> None:
    """Wrap ``DataLoader._get_iterator``, which starts the workers (mask=False: nothing)."""
    if not getattr(settings, "mask", True):
        return
    from torch.utils.data import dataloader

    _registry.wrap(dataloader.DataLoader, "_get_iterator", _get_iterator_wrapper, group=__name__)


def uninstall() -> None:
    """Restore ``DataLoader._get_iterator``."""
    _registry.restore_group(__name__)


def _get_iterator_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any
) -> Any:
    settings = current()
    carried = hf_collators.carry(instance.collate_fn) if instance.num_workers > 0 else None
    if settings is None or carried is None or isinstance(instance.worker_init_fn, WorkerMasking):
        return wrapped(*args, **kwargs)
    user_init_fn = instance.worker_init_fn
    instance.worker_init_fn = WorkerMasking(settings, carried, user_init_fn)
    try:
        return wrapped(*args, **kwargs)
    finally:
        instance.worker_init_fn = user_init_fn
