"""Installs and removes every library patch, now or when its target library gets imported.

Each name in ``PATCH_MODULES`` is a module of this package exposing ``TARGETS`` (module names whose
import triggers it), ``install(settings, target)`` and ``uninstall()``. A target already imported is
patched at once; any other gets a wrapt post-import hook, so ``enable()`` works whether the
library is imported before or after it. Post-import hooks cannot be unregistered, so the hook
checks the registry state: after ``disable()`` it does nothing, and it installs once per enable.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import wrapt

from autooffload.log import logger
from autooffload.patches import _registry
from autooffload.settings import Settings

PATCH_MODULES: tuple[str, ...] = (
    "torch_module",
    "torch_optim",
    "transformers_loading",
    "transformers_resize",
    "transformers_loss",
    "peft_lora",
    "bnb",
    "hf_collators",
    "trl_fused_head",
    "torch_ddp",
    "checkpoint_consolidation",
    "sharded_generate",
    "dataloader_workers",
)

# The patch modules ``autooffload.attach()`` needs without ``enable()``: each of their wrappers
# acts on attached models, their parameters and the optimizers bound to them only, and passes
# anything else straight through (nothing global changes for objects attach() was not given).
ATTACH_PATCH_MODULES: tuple[str, ...] = (
    "torch_module",
    "torch_optim",
    "peft_lora",
    "transformers_resize",
)

# The registry state: the settings of the current enable() (None when disabled), the
# (patch module, target) pairs installed under it, the patch modules used, and the targets whose
# post-import hook is registered and has not fired yet (wrapt drops a hook once it fires).
_active_settings: Settings | None = None
_installed: set[tuple[str, str]] = set()
_loaded: dict[str, ModuleType] = {}
_pending_hooks: set[str] = set()
# (patch module, target) pairs installed for attach() alone, while no enable() is in force.
_for_attach: set[tuple[str, str]] = set()


def _install(name: str, target: str) -> None:
    if _active_settings is None or (name, target) in _installed:
        return
    _installed.add((name, target))
    logger.debug("installing patch %s for %s", name, target)
    _loaded[name].install(_active_settings, target)


def _on_import(module: ModuleType) -> None:
    """wrapt post-import hook: patch ``module`` with every loaded patch module targeting it."""
    target = module.__name__
    _pending_hooks.discard(target)
    for name, patch_module in list(_loaded.items()):
        if target in patch_module.TARGETS:
            _install(name, target)


def install_all(settings: Settings, names: tuple[str, ...] | None = None) -> None:
    """Install the patch modules ``names`` (default: ``PATCH_MODULES``) with ``settings``;
    targets not imported yet get a hook."""
    global _active_settings
    release_for_attach()
    _active_settings = settings
    for name in PATCH_MODULES if names is None else names:
        patch_module = importlib.import_module(f"{__name__}.{name}")
        _loaded[name] = patch_module
        for target in patch_module.TARGETS:
            if sys.modules.get(target) is not None:  # None: an import blocked on purpose
                _install(name, target)
            elif target not in _pending_hooks:
                _pending_hooks.add(target)
                wrapt.register_post_import_hook(_on_import, target)


def uninstall_all() -> None:
    """Uninstall every patch module and restore every wrapped attribute by identity."""
    global _active_settings
    _active_settings = None
    try:
        for patch_module in reversed(list(_loaded.values())):
            patch_module.uninstall()
    finally:
        _installed.clear()
        _loaded.clear()
        _registry.restore_all()


def hold_for_attach(settings: Settings) -> None:
    """Install the patches an attached model needs (``ATTACH_PATCH_MODULES``) when no
    ``enable()`` is in force; ``release_for_attach`` removes them when the last model detaches.
    Targets not imported yet are left alone: a model using them imported them already."""
    if _active_settings is not None or _for_attach:
        return
    for name in ATTACH_PATCH_MODULES:
        patch_module = importlib.import_module(f"{__name__}.{name}")
        for target in patch_module.TARGETS:
            if sys.modules.get(target) is not None:
                logger.debug("installing patch %s for %s (attach)", name, target)
                patch_module.install(settings, target)
                _for_attach.add((name, target))


def release_for_attach() -> None:
    """Remove the patches ``hold_for_attach`` installed, if any."""
    if not _for_attach:
        return
    names = {name for name, _ in _for_attach}
    _for_attach.clear()
    for name in reversed(ATTACH_PATCH_MODULES):
        if name in names:
            importlib.import_module(f"{__name__}.{name}").uninstall()


def is_installed() -> bool:
    """Whether patches are installed (between ``install_all`` and ``uninstall_all``)."""
    return _active_settings is not None
