"""The update in the backward on the GPU side: persistent chunks stepped as their backward ends.

Under the update in the backward (``runtime/update/update_mode.py``) the offloaded chunks are
updated on the CPU as their gradients arrive. The persistent chunks' gradients would otherwise all
live on the device from their backward to ``optimizer.step()``: at 3.6B under 16 GiB 3.6 GB with 15
persistent chunks, at the step. Instead, as soon as the backward is past every user of a chunk
(``StepHooks._pre_backward``; ``_end_backward`` for the rest), the chunk's params are stepped by
their own optimizer, restricted to them (``step_params``: the user's optimizer object, its state and
hyperparameters, so the update is the one ``step()`` would have made), and their ``.grad`` is
dropped: at most the gradients of the chunks the backward is in live at once, and ``step()`` skips
the params (torch optimizers skip a param whose ``.grad`` is None). The planner counts the
persistent gradients that way under the update in the backward (``ChunkTables.persist_grad_live``),
which leaves room for more persistent chunks.

What the user sees: after ``backward()`` a persistent param's ``.grad`` is None, as an
offloaded one's always is (gradient clipping and GradScaler go through autooffload's patches,
which keep the mode off for loops that use them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# ``Optimizer.step`` of torch.optim classes is wrapped by ``profile_hook_step`` (global and
# per-optimizer step hooks, autooffload's own ``after_step`` among them); the wrapped function
# is the update alone.


def raw_step(optimizer: torch.optim.Optimizer) -> Callable[..., Any] | None:
    """The update of ``optimizer``'s class without torch's step hooks; None if there is none."""
    step = type(optimizer).step
    return getattr(step, "__wrapped__", None) if getattr(step, "hooked", False) else None


def step_params(optimizer: torch.optim.Optimizer, ids: set[int]) -> list[int]:
    """Run ``optimizer``'s update on its params whose id is in ``ids`` only; return the indices
    of the groups that had any. The groups are shallow copies holding those params (same
    hyperparameters); state is per param, so the others' is untouched."""
    step = raw_step(optimizer)
    if step is None:
        raise TypeError(f"{type(optimizer).__name__}.step has no torch step-hook wrapper")
    groups = optimizer.param_groups
    used, subset = [], []
    for index, group in enumerate(groups):
        kept = [p for p in group["params"] if id(p) in ids]
        if kept:
            used.append(index)
            subset.append({**group, "params": kept})
    if not subset:
        return used
    optimizer.param_groups = subset
    try:
        step(optimizer)
    finally:
        optimizer.param_groups = groups
    return used
