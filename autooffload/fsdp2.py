"""``fsdp2_wrap``: shard a model with FSDP2 by a size-based policy, for users who take that path.

A model sharded with FSDP2 (``fully_shard``) gets no weight offload from autooffload: FSDP2's own
``CPUOffloadPolicy`` is the tool there, and a ``.to()`` of such a model is left alone. Masking
applies as usual. See docs/distributed.md.
"""

from __future__ import annotations

from typing import Any

from torch import nn

DEFAULT_MIN_NUM_PARAMS = 100_000_000


def fsdp2_wrap(
    model: nn.Module, min_num_params: int = DEFAULT_MIN_NUM_PARAMS, **kwargs: Any
) -> nn.Module:
    """Apply FSDP2 ``fully_shard`` to every module holding at least ``min_num_params`` params not
    already in a sharded descendant (bottom-up, like FSDP1's ``size_based_auto_wrap_policy``),
    then to ``model`` itself; return ``model``.

    ``kwargs`` go to every ``fully_shard`` call (``mesh``, ``mp_policy``, ``offload_policy``,
    ``reshard_after_forward``). Needs an initialised default process group.
    """
    from torch.distributed.fsdp import fully_shard

    if (
        isinstance(min_num_params, bool)
        or not isinstance(min_num_params, int)
        or min_num_params < 1
    ):
        raise ValueError(
            f"fsdp2_wrap: min_num_params must be a positive int (got {min_num_params!r});"
            f" the default is {DEFAULT_MIN_NUM_PARAMS}"
        )
    seen: set[int] = set()
    # Every name of every parameter: a tied one (embedding / LM head) must stay in a unit that
    # holds all of its users, or FSDP2 refuses it.
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)

    def eligible(prefix: str, module: nn.Module) -> bool:
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):  # no forward to hook
            return False
        params = [p for p in module.parameters() if id(p) not in seen]
        if sum(p.numel() for p in params) < min_num_params:
            return False
        return all(n.startswith(prefix + ".") for p in params for n in names[id(p)])

    def visit(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            visit(f"{prefix}.{child_name}" if prefix else child_name, child)
        if module is not model and eligible(prefix, module):
            fully_shard(module, **kwargs)
            seen.update(id(p) for p in module.parameters())

    visit("", model)
    fully_shard(model, **kwargs)
    return model
