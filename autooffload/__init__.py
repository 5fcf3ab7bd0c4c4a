"""The public surface of autooffload: enable, disable, attach, last_plan, Settings.

``import autooffload; autooffload.enable()`` at the top of an unchanged training script is the
whole integration; importing the package alone changes nothing.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from autooffload import log, openmp, patches
from autooffload import settings as _settings
from autooffload.errors import (
    AttachError,
    AutoOffloadError,
    HostMemoryError,
    OutOfStepError,
    PlanError,
    SettingsError,
    UnsupportedAutogradError,
)
from autooffload.settings import Settings

if TYPE_CHECKING:
    from autooffload.plan.types import Plan

__version__ = "0.1.0"

__all__ = [
    "AttachError",
    "AutoOffloadError",
    "HostMemoryError",
    "OutOfStepError",
    "PlanError",
    "Settings",
    "SettingsError",
    "UnsupportedAutogradError",
    "__version__",
    "attach",
    "disable",
    "enable",
    "fsdp2_wrap",
    "gathered",
    "last_plan",
    "no_sync",
    "consolidate",
]


def enable(**overrides: Any) -> Settings:
    """Turn autooffload on for this process and return the Settings in force.

    Reads the ``AUTOOFFLOAD_*`` env vars, applies ``overrides`` (kwargs win) and validates
    everything before changing anything; then configures the ``autooffload`` logger and installs
    the library patches (now for libraries already imported, on import for the others). Calling
    it again with the same settings does nothing; with different settings it reinstalls the
    patches. With ``AUTOOFFLOAD=0`` (``enabled=False``) it validates, turns autooffload off if it
    was on, and returns.
    """
    settings = Settings.from_env(**overrides)
    log.configure(settings.log)
    active = _settings.current()
    if not settings.enabled:
        if active is not None:
            disable()
        log.logger.debug("autooffload is disabled by AUTOOFFLOAD=0 / enabled=False")
        return settings
    openmp.prefer_passive()  # before the patches import torch, which loads OpenMP
    if active is not None:
        if active == settings and patches.is_installed():
            return active
        patches.uninstall_all()
    _settings._set_current(settings)
    patches.install_all(settings)
    log.logger.debug("autooffload enabled: %s", settings)
    return settings


def disable() -> None:
    """Turn autooffload off: detach every attached model and restore every patched object."""
    try:
        runtime = sys.modules.get("autooffload.runtime")
        detach_all = getattr(runtime, "detach_all", None)
        if detach_all is not None:
            detach_all()
    finally:
        patches.uninstall_all()
        _settings._set_current(None)
        log.reset_warnings()


def attach(model: Any, optimizer: Any = None, **settings: Any) -> Any:
    """Attach ``model`` (and ``optimizer``) explicitly and return its ``Runtime``.

    ``settings`` are Settings fields overriding the env vars, validated as in ``enable()``.
    """
    resolved = Settings.from_env(**settings)
    from autooffload.runtime import attach as attach_runtime

    return attach_runtime(model, optimizer, resolved)


def fsdp2_wrap(model: Any, min_num_params: int = 100_000_000, **kwargs: Any) -> Any:
    """Shard ``model`` with FSDP2 ``fully_shard`` by size (modules over ``min_num_params`` each
    get their own unit, then the root); autooffload then leaves its weights to FSDP2."""
    from autooffload.fsdp2 import fsdp2_wrap as _wrap

    return _wrap(model, min_num_params, **kwargs)


def no_sync(model: Any) -> contextlib.AbstractContextManager[None]:
    """Skip cross-rank gradient averaging of ``model``'s persistent and resident params for the
    backward passes inside (gradient accumulation under torchrun, like ``DDP.no_sync``)."""
    from autooffload.runtime.parallel.distributed import no_sync as _no_sync

    return _no_sync(model)


def consolidate(model: Any, to: int | None = 0) -> None:
    """Call on every rank before saving a checkpoint when the weights and CPU optimizer state
    of offloaded chunks are sharded across data-parallel ranks (``AUTOOFFLOAD_SHARD_OPTIMIZER``,
    on by default under torchrun): rank ``to``'s ``model.state_dict()`` and
    ``optimizer.state_dict()`` then hold the whole model and state in torch's standard layout,
    until the next step (``to=None``: on every rank, at the cost of a full host copy each). A
    no-op without sharding. HF ``Trainer`` and accelerate's ``save_state`` call it for you.
    """
    from autooffload import runtime as rt
    from autooffload.runtime.parallel.sharding import consolidate as _consolidate

    for runtime in rt.runtimes_in(model):
        _consolidate(runtime, to)


def last_plan() -> Plan | None:
    """The Plan of the most recent attach in this process, or ``None`` if nothing was attached."""
    runtime = sys.modules.get("autooffload.runtime")
    get_last_plan = getattr(runtime, "last_plan", None)
    return None if get_last_plan is None else get_last_plan()


@contextlib.contextmanager
def gathered(params: Any, modify: bool = False) -> Iterator[None]:
    """Make the parameters of an attached model readable (and, with ``modify``, writable) in
    the block: their chunks are gathered on the device and held there; changes made with
    ``modify=True`` are stored back at exit. Outside a forward, the storage of an offloaded
    parameter is released, so reading it directly is invalid (as with DeepSpeed ZeRO-3's
    ``GatheredParameters``). ``params``: a module, a parameter or an iterable of them. A no-op
    for parameters no attached model owns."""
    import torch

    if isinstance(params, torch.nn.Module):
        params = list(params.parameters())
    elif isinstance(params, torch.Tensor):
        params = [params]
    else:
        params = list(params)
    runtime_module = sys.modules.get("autooffload.runtime")
    if runtime_module is None:
        yield
        return
    from autooffload.runtime.access import params_on_device, runtime_managing

    runtime = runtime_managing(params)
    if runtime is None:
        yield
        return
    runtime.cpu_optim.early.check_no_early_read("autooffload.gathered()")
    with params_on_device(runtime, params, written=params if modify else ()):
        yield
