"""torch.optim patches: bind optimizers to attached models, step/zero_grad the CPU part, clip
gradients over GPU and host gradients together, and save/load the state of every param; AMP
loss scaling over host gradients, and clean-up after a backward that raised.

``Optimizer.step`` is overridden by every subclass, so a wrapper on the base class would not
run; the ``profile_hook_step`` wrapper every optimizer's ``step`` goes through is the reliable
entry point: its global pre hook starts the step, and ``Optimizer._optimizer_step_code``, which
it calls right after the update and before the optimizer's own post hooks, queues the CPU part,
so those hooks see the stepped weights and the hyperparameters the step used.
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.amp.grad_scaler
import torch.nn.utils
import torch.nn.utils.clip_grad
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from autooffload.patches import _registry
from autooffload.settings import Settings

TARGETS = ("torch",)

# torch.optim classes whose own ``__init__`` fills per-param state (Adagrad's sums).
EAGER_STATE_OPTIMIZERS = (torch.optim.Adagrad,)

_handles: list[RemovableHandle] = []


def _runtimes_of_optimizer(optimizer: torch.optim.Optimizer) -> list:
    from autooffload import runtime as rt

    return [r for r in rt.runtimes() if any(o is optimizer for o in r.optimizers)]


def _bind(optimizer: torch.optim.Optimizer) -> None:
    from autooffload import runtime as rt

    params = [p for g in optimizer.param_groups for p in g["params"]]
    for runtime in rt.runtimes():
        # Chunked or resident params, or any other param of the attached model (adapters
        # PEFT injected after attach): its steps drive the profiling steps and the CPU update.
        in_model = {id(p) for p in runtime.model.parameters()}
        if any(runtime.manages(p) or id(p) in in_model for p in params):
            runtime.bind_optimizer(optimizer)


def _init_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    # Subclasses call Optimizer.__init__ before finishing their own set-up; bind needs only
    # param_groups, which the base __init__ has filled.
    _bind(instance)
    return result


def _eager_state_init_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``__init__`` of an optimizer class that fills per-param state itself, after the base
    ``__init__`` bound it: the offloaded params' part moves to the CPU twins, which would
    otherwise start from their own defaults (Adagrad's ``initial_accumulator_value``)."""
    result = wrapped(*args, **kwargs)
    if instance.state:
        for runtime in _runtimes_of_optimizer(instance):
            runtime.adopt_optimizer_state(instance)
    return result


def _add_param_group_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """A group added to a bound optimizer: its offloaded params get CPU twins too (they were
    never updated otherwise). ``Optimizer.__init__`` adds its groups before it is bound."""
    result = wrapped(*args, **kwargs)
    # Not bound yet (in ``__init__``, or built before attach): bound whole at its first step.
    for runtime in _runtimes_of_optimizer(instance):
        runtime.rebind_optimizer(instance)
    return result


def _bound_runtimes(optimizer: torch.optim.Optimizer) -> list:
    """The runtimes ``optimizer`` is bound to, binding it first if it was built before attach."""
    if not _runtimes_of_optimizer(optimizer):
        _bind(optimizer)
    return _runtimes_of_optimizer(optimizer)


def _pre_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    # A forward or backward cut short since the last step may have left offloaded gradients
    # on the device (the user's optimizer would update them there) and stale chunks resident;
    # before the first update, a budget no plan fits stops the run.
    for runtime in _bound_runtimes(optimizer):
        runtime.before_step(optimizer)


def _step_code_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``Optimizer._optimizer_step_code``: called between a step's update and its post hooks."""
    result = wrapped(*args, **kwargs)
    _post_step(instance)
    return result


def _post_step(optimizer: torch.optim.Optimizer) -> None:
    runtimes = _bound_runtimes(optimizer)
    apply_update = True
    found_inf = getattr(optimizer, "found_inf", None)
    if isinstance(found_inf, torch.Tensor) and runtimes:
        # A GradScaler stepping a fused optimizer: the kernel skips the step when found_inf
        # is set, else divides the gradients by grad_scale; the CPU part does the same.
        apply_update = not bool(found_inf.item())
        grad_scale = getattr(optimizer, "grad_scale", None)
        if apply_update and isinstance(grad_scale, torch.Tensor):
            ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
            for runtime in runtimes:
                runtime.cpu_optim.grad_norms.clip_(1.0 / float(grad_scale), ids)
    for runtime in runtimes:
        runtime.after_step(optimizer, apply_update=apply_update)


def _backward_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``torch.autograd.backward`` (``Tensor.backward`` calls it): a device OOM in the backward
    of an attached model's output is retried once (``runtime/control/oom.py``); on any other
    exception (or Ctrl-C) the runtimes clean up at once instead of at the next forward or step."""
    from autooffload.runtime.control.oom import run_backward

    return run_backward(wrapped, args, kwargs)


def _unscale_args(
    optimizer: torch.optim.Optimizer,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    allow_fp16: bool,
) -> tuple[torch.optim.Optimizer, torch.Tensor, bool]:
    return optimizer, inv_scale, allow_fp16


def _unscale_grads_with_host(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``GradScaler._unscale_grads_`` that also unscales the host gradients of offloaded params
    and reports non-finite values found in them: ``unscale_`` and the inf check before a fused
    optimizer's step both go through it, and ``step`` skips ``optimizer.step`` on what it finds."""
    per_device = wrapped(*args, **kwargs)
    optimizer, inv_scale, allow_fp16 = _unscale_args(*args, **kwargs)
    runtimes = _bound_runtimes(optimizer)
    if not runtimes:
        return per_device
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    host_found = torch.zeros((), dtype=torch.float32)
    unit = torch.ones((), dtype=torch.float32)
    for runtime in runtimes:
        runtime.hooks.offload_assigned_grads()
        cpu_optim = runtime.cpu_optim
        # Waits for pending accumulations, applies pending clipping.
        cpu_optim.grad_norms.host_grads()
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for pid in ids:
            master = cpu_optim.masters.get(pid)
            if master is not None and master.grad is not None:
                by_dtype.setdefault(master.grad.dtype, []).append(master.grad)
        if torch.float16 in by_dtype and not allow_fp16:
            raise ValueError("Attempting to unscale FP16 gradients.")
        for grads in by_dtype.values():
            # Only checked here (unit scale): the unscale goes through the CPU optimizer's
            # gradient scaling, which keeps its clipping norms consistent.
            torch._amp_foreach_non_finite_check_and_unscale_(grads, host_found, unit)
        cpu_optim.grad_norms.clip_(float(inv_scale), ids)
    if any(r.cpu_optim.sharding is not None for r in runtimes):
        # Each rank checked only the host gradients it owns: all must skip the step alike.
        sharding = next(r.cpu_optim.sharding for r in runtimes if r.cpu_optim.sharding)
        sharding.all_reduce_(host_found, torch.distributed.ReduceOp.MAX)
    if per_device:
        # Folded into one existing entry: fused kernels skip only on found_inf == 1, and
        # GradScaler sums the entries of all devices.
        device, found = next(iter(per_device.items()))
        torch.maximum(found, host_found.to(device), out=found)
    else:
        per_device[torch.device("cpu")] = host_found
    return per_device


def _maybe_opt_step_with_host(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``GradScaler._maybe_opt_step``: a step skipped for non-finite gradients never calls
    ``optimizer.step``, so the runtimes are told here (no CPU update; the step still ends)."""
    optimizer, optimizer_state = args[0], args[1]
    skipped = bool(sum(v.item() for v in optimizer_state["found_inf_per_device"].values()))
    result = wrapped(*args, **kwargs)
    if skipped:
        for runtime in _runtimes_of_optimizer(optimizer):
            runtime.after_step(optimizer, apply_update=False)
    return result


def _zero_grad_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    set_to_none = kwargs.get("set_to_none", args[0] if args else True)
    runtimes = _runtimes_of_optimizer(instance)
    if runtimes:
        # Its own params only, as torch's: a param outside it keeps accumulating.
        ids = {id(p) for group in instance.param_groups for p in group["params"]}
        for runtime in runtimes:
            runtime.zero_grad(set_to_none, ids)
    return result


def clip_grad_norm_with_host(
    wrapped: Any,
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``clip_grad_norm_`` whose norm covers the host gradients of offloaded parameters."""
    params, owners = _params_and_owners(parameters)
    if not owners:
        return wrapped(params, max_norm, norm_type, error_if_nonfinite, foreach)
    norm_type = float(norm_type)
    device_grads = [p.grad for p in params if p.grad is not None]
    norms = []
    if device_grads:
        norms.append(torch.nn.utils.get_total_norm(device_grads, norm_type, False, foreach))
    ids = {id(p) for p in params}
    for runtime in owners:
        host_norm = runtime.cpu_optim.grad_norms.host_grad_norm(norm_type, ids)
        if host_norm is not None:
            norms.append(host_norm)
    device = device_grads[0].device if device_grads else owners[0].device
    parts = torch.stack([n.to(device=device, dtype=torch.float32) for n in norms])
    total = parts.max() if math.isinf(norm_type) else torch.linalg.vector_norm(parts, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite,"
            " so it cannot be clipped. To disable this error and scale the gradients by the"
            " non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    # torch's own second half (the public name is patched to this very function's tail).
    _clip_with_norm(
        torch.nn.utils.clip_grad._clip_grads_with_norm_, params, owners, max_norm, total, foreach
    )
    return total


def _clip_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    return clip_grad_norm_with_host(wrapped, *args, **kwargs)


def _params_and_owners(
    parameters: torch.Tensor | Iterable[torch.Tensor],
) -> tuple[list[torch.Tensor], list]:
    """The parameters as a list, and the runtimes holding any of them offloaded."""
    from autooffload import runtime as rt

    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owners = [r for r in rt.runtimes() if any(r.is_offloaded(p) for p in params)]
    for runtime in owners:
        runtime.hooks.offload_assigned_grads()  # gradients set by hand count like the rest
    return params, owners


def _clip_with_norm(
    device_clip: Any,
    params: list[torch.Tensor],
    owners: list,
    max_norm: float,
    total_norm: torch.Tensor,
    foreach: bool | None,
) -> None:
    """Scale the device gradients (``device_clip``, torch's kernel; it refuses an empty list)
    and the host gradients of ``params`` by ``min(1, max_norm / (total_norm + 1e-6))``."""
    on_device = [p for p in params if p.grad is not None]
    if on_device:
        device_clip(on_device, max_norm, total_norm, foreach)
    coef = float(torch.clamp(max_norm / (total_norm + 1e-6), max=1.0))
    ids = {id(p) for p in params}
    for runtime in owners:
        runtime.cpu_optim.grad_norms.clip_(coef, ids)


def clip_grad_value_with_host(
    wrapped: Any,
    parameters: torch.Tensor | Iterable[torch.Tensor],
    clip_value: float,
    foreach: bool | None = None,
) -> None:
    """``clip_grad_value_`` that clamps the host gradients of offloaded parameters too."""
    params, owners = _params_and_owners(parameters)
    if not owners:
        return wrapped(params, clip_value, foreach)
    on_device = [p for p in params if p.grad is not None]
    if on_device:  # torch's kernel refuses an empty list
        wrapped(on_device, clip_value, foreach)
    ids = {id(p) for p in params}
    for runtime in owners:
        runtime.cpu_optim.grad_norms.clamp_(float(clip_value), ids)
    return None


def _clip_value_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    return clip_grad_value_with_host(wrapped, *args, **kwargs)


def clip_grads_with_norm_with_host(
    wrapped: Any,
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    total_norm: torch.Tensor,
    foreach: bool | None = None,
) -> None:
    """``clip_grads_with_norm_`` (the second half of ``clip_grad_norm_``) scaling the host
    gradients of offloaded parameters by the same coefficient."""
    params, owners = _params_and_owners(parameters)
    if not owners:
        return wrapped(params, max_norm, total_norm, foreach)
    _clip_with_norm(wrapped, params, owners, max_norm, total_norm, foreach)
    return None


def _clip_with_norm_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    return clip_grads_with_norm_with_host(wrapped, *args, **kwargs)


@contextlib.contextmanager
def _hooks_held_back(optimizer: torch.optim.Optimizer, *names: str) -> Iterator[list[dict]]:
    """The optimizer's hook dicts ``names`` emptied while inside (torch's own method then runs
    none of them); yields their hooks, for the caller to run where they see the whole state."""
    held = [getattr(optimizer, name) for name in names]
    try:
        for name in names:
            setattr(optimizer, name, OrderedDict())
        yield [dict(hooks) for hooks in held]
    finally:
        for name, hooks in zip(names, held, strict=True):
            setattr(optimizer, name, hooks)


def _state_dict_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``Optimizer.state_dict`` with the CPU twins' state of offloaded params merged in, before
    the optimizer's state-dict post hooks, which see it as on a plain model."""
    from autooffload.runtime.state import add_offloaded_state

    runtimes = _runtimes_of_optimizer(instance)
    if not runtimes:
        return wrapped(*args, **kwargs)
    with _hooks_held_back(instance, "_optimizer_state_dict_post_hooks") as (post_hooks,):
        state_dict = wrapped(*args, **kwargs)
    for runtime in runtimes:
        add_offloaded_state(runtime, instance, state_dict)
    for post_hook in post_hooks.values():
        hook_result = post_hook(instance, state_dict)
        if hook_result is not None:
            state_dict = hook_result
    return state_dict


def _load_state_dict_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``Optimizer.load_state_dict`` that gives offloaded params' state to the CPU twins."""
    from autooffload.runtime.state import load_offloaded_state, split_offloaded_state

    # Bound first (an optimizer built before attach is bound at its first step otherwise):
    # torch would put the offloaded params' state on their device.
    runtimes = _bound_runtimes(instance)
    if not runtimes:
        return wrapped(*args, **kwargs)
    # torch's own copy; its load-state-dict hooks see the whole state, before the split and
    # after the offloaded params' state is loaded.
    state_dict = (kwargs.pop("state_dict") if "state_dict" in kwargs else args[0]).copy()
    hook_names = ("_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")
    with _hooks_held_back(instance, *hook_names) as (pre_hooks, post_hooks):
        for pre_hook in pre_hooks.values():
            hook_result = pre_hook(instance, state_dict)
            if hook_result is not None:
                state_dict = hook_result
        per_runtime = []
        for runtime in runtimes:
            state_dict, offloaded = split_offloaded_state(runtime, instance, state_dict)
            per_runtime.append((runtime, offloaded))
        # The user's optimizer first: twins built afterwards take its loaded hyperparameters.
        result = wrapped(state_dict)
        for runtime, offloaded in per_runtime:
            load_offloaded_state(runtime, instance, offloaded)
    for post_hook in post_hooks.values():
        post_hook(instance)
    return result


def install(settings: Settings, target: str) -> None:
    group = __name__
    _registry.wrap(torch.optim.Optimizer, "__init__", _init_wrapper, group)
    for optimizer_class in EAGER_STATE_OPTIMIZERS:
        _registry.wrap(optimizer_class, "__init__", _eager_state_init_wrapper, group)
    _registry.wrap(torch.optim.Optimizer, "_optimizer_step_code", _step_code_wrapper, group)
    _registry.wrap(torch.optim.Optimizer, "zero_grad", _zero_grad_wrapper, group)
    _registry.wrap(torch.optim.Optimizer, "add_param_group", _add_param_group_wrapper, group)
    _registry.wrap(torch.nn.utils.clip_grad, "clip_grad_norm_", _clip_wrapper, group)
    _registry.wrap(torch.nn.utils, "clip_grad_norm_", _clip_wrapper, group)
    for owner in (torch.nn.utils, torch.nn.utils.clip_grad):
        _registry.wrap(owner, "clip_grad_value_", _clip_value_wrapper, group)
    # The public name only: torch's own clip_grad_norm_ (and ours) call the private one.
    _registry.wrap(torch.nn.utils, "clip_grads_with_norm_", _clip_with_norm_wrapper, group)
    _registry.wrap(torch.optim.Optimizer, "state_dict", _state_dict_wrapper, group)
    _registry.wrap(torch.optim.Optimizer, "load_state_dict", _load_state_dict_wrapper, group)
    _registry.wrap(torch.autograd, "backward", _backward_wrapper, group)
    scaler = torch.amp.grad_scaler.GradScaler
    _registry.wrap(scaler, "_unscale_grads_", _unscale_grads_with_host, group)
    _registry.wrap(scaler, "_maybe_opt_step", _maybe_opt_step_with_host, group)
    if not _handles:
        _handles.append(register_optimizer_step_pre_hook(_pre_step))


def uninstall() -> None:
    _registry.restore_group(__name__)
    while _handles:
        _handles.pop().remove()
