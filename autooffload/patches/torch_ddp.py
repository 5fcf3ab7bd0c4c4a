"""DistributedDataParallel over an attached model: DDP must not reduce what autooffload reduces.

An attached model averages its chunk-managed gradients itself (``runtime/parallel/distributed.py``),
and its offloaded parameters have no device storage between uses, which DDP's reducer and its
start-up broadcast cannot handle. Wrapping such a model (by the script, ``accelerate``, or HF
``Trainer``) therefore:

* registers every parameter autooffload manages as ignored by DDP, so DDP keeps reducing only
  the others (parameters the runtime does not own, if any), re-checking names on every wrap;
* when nothing is left for DDP, makes the wrapper a pass-through: ``forward`` calls the module,
  ``no_sync()`` keeps working (it pauses autooffload's persistent-gradient averaging), and
  ``.module`` is the model, as scripts and ``accelerate.unwrap_model`` expect;
* broadcasts rank 0's weights and buffers into every rank's replica, as DDP does at start-up.

With one rank (``torchrun --nproc-per-node 1``, which HF Trainer and accelerate still wrap in
DDP) the same pass-through applies, with nothing to average. Under several ranks a model
attached with ``AUTOOFFLOAD_DATA_PARALLEL=off`` cannot be wrapped: a clear error says so.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from autooffload.errors import AttachError
from autooffload.log import logger
from autooffload.patches import _registry
from autooffload.settings import Settings

TARGETS = ("torch.nn.parallel.distributed",)


def _runtimes(module: nn.Module) -> list[Any]:
    """The runtimes attached inside ``module``, each once (sync_replica broadcasts the whole
    model per runtime). Under a group of several ranks each must average its gradients."""
    from autooffload import runtime as rt
    from autooffload.runtime.parallel.distributed import world

    runtimes = rt.runtimes_in(module)
    _, size = world()
    if size > 1 and any(r.data_parallel is None for r in runtimes):
        raise AttachError(
            "DistributedDataParallel over a model attached with AUTOOFFLOAD_DATA_PARALLEL=off:"
            " DDP cannot reduce or broadcast offloaded parameters (they have no device storage"
            " between uses). Set AUTOOFFLOAD_DATA_PARALLEL=auto (autooffload averages the"
            " gradients, DDP becomes a pass-through), or do not wrap the model in DDP"
        )
    return runtimes


def _init(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    module = args[0] if args else kwargs.get("module")
    runtimes = _runtimes(module) if isinstance(module, nn.Module) else []
    if not runtimes:
        return wrapped(*args, **kwargs)
    managed = {
        name
        for name, param in module.named_parameters(remove_duplicate=False)
        if any(r.manages(param) for r in runtimes)
    }
    # One rank (``torchrun --nproc-per-node 1``): nothing to average or broadcast, but DDP's
    # own start-up broadcast would still read offloaded params.
    for runtime in runtimes:
        if runtime.data_parallel is not None:
            runtime.data_parallel.sync_replica(runtime)
    rest = [p for n, p in module.named_parameters() if n not in managed and p.requires_grad]
    if rest:
        ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ())) | managed
        module._ddp_params_and_buffers_to_ignore = sorted(ignored)
        logger.debug("DDP reduces %d params autooffload does not manage", len(rest))
        return wrapped(*args, **kwargs)
    nn.Module.__init__(instance)
    instance.module = module
    instance.require_backward_grad_sync = True
    instance.require_forward_param_sync = False
    instance.device_ids = kwargs.get("device_ids") or (args[1] if len(args) > 1 else None)
    instance._autooffload_runtimes = runtimes
    logger.debug("DDP wrapper over an attached model: gradients are averaged by autooffload")
    return None


def _forward(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    runtimes = getattr(instance, "_autooffload_runtimes", None)
    if runtimes is None:
        return wrapped(*args, **kwargs)
    # DDP decides at forward time whether the coming backward synchronises (no_sync()).
    for runtime in runtimes:
        if runtime.data_parallel is not None:
            runtime.data_parallel.set_sync(instance.require_backward_grad_sync)
    return instance.module(*args, **kwargs)


def install(settings: Settings, target: str) -> None:
    ddp = sys.modules[target].DistributedDataParallel
    _registry.wrap(ddp, "__init__", _init, __name__)
    _registry.wrap(ddp, "forward", _forward, __name__)


def uninstall() -> None:
    _registry.restore_group(__name__)
