"""transformers patch: ``generate`` on a model whose weights are sharded across ranks keeps
every rank's forwards in step (``synced_gpus``), as transformers does itself for DeepSpeed
ZeRO-3 and FSDP.

Under sharded state (``runtime/parallel/sharding.py``) every gather of an offloaded trainable chunk
is a collective: each rank must run the same number of forwards. Ranks generating from their own
prompts stop at different lengths (one reaches EOS first) and would then pair one rank's
gathers with another's next forward, or hang. With ``synced_gpus=True`` a rank that finished
keeps running forwards until every rank has; transformers turns it on only when it detects
ZeRO-3 or FSDP, so ``GenerationMixin.generate`` is wrapped to pass it where the model (or a
module in it) is attached with sharded state under data parallelism and the caller left it
unset. An explicit ``synced_gpus`` is kept.
"""

from __future__ import annotations

import sys
from typing import Any

from autooffload.patches import _registry
from autooffload.settings import Settings

TARGETS = ("transformers.generation.utils",)

# ``generate``'s parameters before ``synced_gpus``: passed positionally, the caller chose it.
_SYNCED_GPUS_POSITION = 5


def _sharded(model: Any) -> bool:
    runtime_module = sys.modules.get("autooffload.runtime")
    if runtime_module is None:
        return False
    return any(r.manager.sharding is not None for r in runtime_module.runtimes_in(model))


def _generate(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    unset = kwargs.get("synced_gpus") is None and len(args) <= _SYNCED_GPUS_POSITION
    if unset and _sharded(instance):
        kwargs = {**kwargs, "synced_gpus": True}
    return wrapped(*args, **kwargs)


def install(settings: Settings, target: str) -> None:
    module = sys.modules[target]
    _registry.wrap(module.GenerationMixin, "generate", _generate, __name__)


def uninstall() -> None:
    _registry.restore_group(__name__)
