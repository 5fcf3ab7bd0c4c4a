"""Install and remove a wrapper on one module's ``forward`` (an instance attribute), exactly."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from autooffload.log import logger


def install_forward(
    module: nn.Module, key: str, state: Any, run: Callable[[Any, tuple, dict], Any]
) -> None:
    """Make ``module.forward`` call ``run(state, args, kwargs)``; ``state`` carries
    ``inner_forward`` (what ``run`` calls), ``prior_forward`` (an instance ``forward`` that was
    there before, or None) and receives ``wrapper``; it is stored on the module under ``key``.
    Inside ``nn.Module.__call__``, so the module's hooks still fire once around it."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        return run(state, args, kwargs)

    functools.update_wrapper(forward, state.inner_forward)
    state.wrapper = forward
    module.__dict__["forward"] = forward
    module.__dict__[key] = state


def remove_forward(module: nn.Module, key: str) -> Any:
    """Undo :func:`install_forward`: ``module.forward`` is again what it was before. If someone
    wrapped ``forward`` after us, ours becomes a pass-through (``state.active`` False) rather
    than drop their wrapper. Returns the removed state, or None."""
    state = module.__dict__.pop(key, None)
    if state is None:
        return None
    state.active = False
    # The wrapper's closure holds ``state``: a cycle keeping the module (its bound
    # ``inner_forward``) alive until a cyclic gc.
    wrapper, state.wrapper = state.wrapper, None
    if module.__dict__.get("forward") is not wrapper:
        logger.debug("forward wrapper of %s left as a pass-through", type(module).__name__)
        return state
    if state.prior_forward is None:
        del module.__dict__["forward"]
    else:
        module.__dict__["forward"] = state.prior_forward
    return state
