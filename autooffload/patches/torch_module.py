"""nn.Module patches: moving a large trainable model to the GPU attaches it instead of copying
it whole; ``zero_grad`` also clears the host gradients of offloaded parameters; printing an
offloaded parameter, ``parameters_to_vector``, ``vector_to_parameters`` and
``AveragedModel.update_parameters`` read and write its real values."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.utils.convert_parameters
import torch.optim.swa_utils
from torch import nn

from autooffload import runtime as rt
from autooffload.errors import AttachError
from autooffload.log import logger
from autooffload.patches import _registry
from autooffload.runtime import registry
from autooffload.runtime.access import params_on_device, runtime_managing
from autooffload.runtime.attachable import COMPILE_UNSUPPORTED
from autooffload.runtime.control.planning import budget_bytes
from autooffload.settings import Settings, current

TARGETS = ("torch",)

# True while an own .to()/.cuda()/.cpu() falls through to torch's implementation (which uses
# _apply): those are the moves of models that are not attached, or handled above.
_moving: ContextVar[bool] = ContextVar("autooffload_moving", default=False)
# True while a library builds parts of a model (PEFT moving new adapters onto their base layer's
# device): those pieces belong to a model that attaches, or is attached, as a whole.
_attach_suppressed: ContextVar[bool] = ContextVar("autooffload_attach_suppressed", default=False)


@contextmanager
def attach_suppressed() -> Iterator[None]:
    """No move inside this context attaches the module it moves."""
    token = _attach_suppressed.set(True)
    try:
        yield
    finally:
        _attach_suppressed.reset(token)


def _unique_param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def attach_device_type(settings: Settings) -> str:
    """The device type whose ``.to()`` attaches: ``settings.device``, else cuda when present,
    else cpu (the CPU simulation: the same machinery with host "device" buffers)."""
    if settings.device is not None:
        return torch.device(settings.device).type
    return "cuda" if torch.cuda.is_available() else "cpu"


# A frozen model attaches on its own (``offload_frozen`` auto) from this share of the GPU
# budget: a reference model or a teacher that big would take the memory the trained model's
# plan needs; a smaller one stays whole on the device, where the trained model's plan counts it.
FROZEN_BUDGET_SHARE = 0.25


def should_attach(model: nn.Module, settings: Settings, device: torch.device) -> bool:
    """Attach on a move to the compute device of a large model that has something to train,
    or of a large frozen one (``settings.offload_frozen``)."""
    if not settings.offload or device.type != attach_device_type(settings):
        return False
    if _attach_suppressed.get():
        return False
    if registry.runtime_of(model) is not None or _runtime_inside(model) is not None:
        return False
    if any(_is_dtensor(p) for p in model.parameters()):
        # Sharded by FSDP2: its CPUOffloadPolicy is the tool for weights (docs/distributed.md).
        logger.debug("FSDP2/DTensor-sharded model: no weight offload (use CPUOffloadPolicy)")
        return False
    if not any(p.requires_grad for p in model.parameters()):
        return _should_stream_frozen(model, settings, device)
    if settings.force_attach:
        return True
    return _unique_param_bytes(model) >= settings.attach_threshold


def _should_stream_frozen(model: nn.Module, settings: Settings, device: torch.device) -> bool:
    """Whether a model with nothing to train attaches (to be streamed, docs/interfaces.md)."""
    if settings.offload_frozen is False:
        return False
    if settings.force_attach:
        return True
    size = _unique_param_bytes(model)
    if size < settings.attach_threshold:
        return False
    if settings.offload_frozen:
        return True
    budget = budget_bytes(settings, rt.resolve_device(settings, device))  # "cuda" -> "cuda:0"
    return budget is not None and size >= FROZEN_BUDGET_SHARE * budget


def _is_dtensor(param: torch.Tensor) -> bool:
    return type(param).__name__ == "DTensor" or hasattr(param, "_local_tensor")


def _runtime_inside(module: nn.Module) -> Any:
    """The runtime of an attached model nested in ``module`` (a PEFT or DDP wrapper), if any."""
    for runtime in registry.runtimes():
        if any(m is runtime.model for m in module.modules()):
            return runtime
    return None


def _apply_around(
    instance: nn.Module,
    params_kept: set[int],
    buffers_kept: set[int],
    convert: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Apply ``convert`` to ``instance``'s params and buffers but those whose ids are kept (what
    an attached runtime manages), as ``nn.Module._apply`` would to them."""
    for param in instance.parameters():
        if id(param) not in params_kept:
            param.data = convert(param.data)
    for module in instance.modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and id(buffer) not in buffers_kept:
                module._buffers[name] = convert(buffer)


def _move_around(instance: nn.Module, runtime: Any, device: torch.device) -> nn.Module:
    """Move what a wrapper adds around an attached model (new adapters, buffers) to ``device``;
    the attached model's own params stay where the runtime keeps them."""
    managed = {id(p) for p in instance.parameters() if runtime.manages(p)}
    inner = {id(b) for b in runtime.model.buffers()}
    _apply_around(instance, managed, inner, lambda t: t.to(device))
    return instance


_DTYPE_METHODS = {
    "float": torch.float32,
    "double": torch.float64,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _converts(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def _keep_dtype(instance: nn.Module, dtype: torch.dtype) -> bool:
    """Whether ``instance`` holds parameters an attached runtime manages: then a conversion to
    ``dtype`` is applied only where it changes nothing of theirs (their dtype already, as
    ``model.float()`` of an fp32 model), to the module's other tensors as torch would; any other
    conversion is refused before anything changed."""
    runtimes = registry.runtimes()
    if not runtimes:
        return False
    params = list(instance.parameters())
    managed = [p for p in params if any(r.manages(p) for r in runtimes)]
    if not managed:
        return False
    if any(_converts(p) and p.dtype != dtype for p in managed):
        raise AttachError(
            f"cannot change the dtype of an attached model to {dtype}; convert the model"
            " before moving it to the GPU (model.to(dtype) then model.to('cuda'))"
        )
    _apply_around(
        instance, {id(p) for p in managed}, set(), lambda t: t.to(dtype) if _converts(t) else t
    )
    return True


def _move(instance: nn.Module, device: torch.device | None, dtype: torch.dtype | None) -> Any:
    """Handle a move of an attached model, or attach; returns NotImplemented to fall through."""
    if device is None and dtype is None:
        return NotImplemented
    runtime = registry.attached(instance)
    if runtime is not None:
        if device.type == runtime.device.type:
            return instance
        rt.detach(instance, device)
        return instance
    inside = _runtime_inside(instance) if device is not None else None
    if inside is not None and dtype is None:
        if device.type != inside.device.type:
            rt.detach(inside.model, device)
            return NotImplemented
        return _move_around(instance, inside, device)
    settings = current()  # None under attach() alone: moves never attach then
    if settings is None or device is None or not should_attach(instance, settings, device):
        return NotImplemented
    if dtype is not None:
        instance.to(dtype=dtype)
    logger.debug("attaching %s on move to %s", type(instance).__name__, device)
    rt.attach(instance, settings=settings, device=device)
    return instance


def _call_through(wrapped: Any, args: tuple, kwargs: dict) -> Any:
    token = _moving.set(True)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _moving.reset(token)


def _to_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    if dtype is not None and _keep_dtype(instance, dtype):
        if device is None:
            return instance
        result = _move(instance, device, None)
        if result is not NotImplemented:
            return result
        rest = {"non_blocking": non_blocking, "memory_format": memory_format}
        return _call_through(wrapped, (device,), {k: v for k, v in rest.items() if v is not None})
    result = _move(instance, device, dtype)
    return _call_through(wrapped, args, kwargs) if result is NotImplemented else result


def _dtype_method_wrapper(dtype: torch.dtype) -> Any:
    """``float()``, ``half()``, ``bfloat16()``, ``double()``: a no-op on an attached model already
    in that dtype, refused otherwise (``_keep_dtype``)."""

    def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        if _keep_dtype(instance, dtype):
            return instance
        return wrapped(*args, **kwargs)

    return wrapper


def _cuda_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    index = kwargs.get("device", args[0] if args else None)
    device = torch.device(
        "cuda"
        if index is None
        else index
        if isinstance(index, str)
        else f"cuda:{index}"
        if isinstance(index, int)
        else index
    )
    result = _move(instance, device, None)
    return _call_through(wrapped, args, kwargs) if result is NotImplemented else result


def _cpu_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    result = _move(instance, torch.device("cpu"), None)
    return _call_through(wrapped, args, kwargs) if result is NotImplemented else result


def _apply_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``float()``, ``half()``, ``bfloat16()``, ``type()``... on an attached model would rewrite
    parameters whose storage the runtime owns: refuse with the fix instead of corrupting them."""
    if registry.runtimes() and not _moving.get():
        for runtime in registry.runtimes():
            if any(m is instance for m in runtime.model.modules()) or _runtime_inside(instance):
                raise AttachError(
                    f"cannot convert or move {type(instance).__name__} while it is attached"
                    " (autooffload manages its parameters); convert the model before moving it"
                    " to the GPU, or call autooffload.runtime.detach(model) first"
                )
    return wrapped(*args, **kwargs)


def _zero_grad_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    set_to_none = kwargs.get("set_to_none", args[0] if args else True)
    for runtime in registry.runtimes():
        if runtime.model is instance or any(m is runtime.model for m in instance.modules()):
            runtime.zero_grad(set_to_none)
    return result


def _param_repr_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``repr(param)`` of an offloaded parameter: its placeholder keeps the shape but has no
    bytes (torch's printer would read out of bounds), so the chunk is gathered for the print."""
    runtime = runtime_managing([instance]) if isinstance(instance, torch.Tensor) else None
    if runtime is None:
        return wrapped(*args, **kwargs)
    with params_on_device(runtime, [instance]):
        return wrapped(*args, **kwargs)


def _runs_by_chunk(runtime: rt.Runtime, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``params`` in order, cut into runs of consecutive params that share a chunk (or no
    chunk), so that each chunk is gathered once per run."""
    runs: list[list[torch.Tensor]] = []
    last: object = object()
    for param in params:
        entry = runtime.slot_index.get(id(param))
        chunk = entry[0].index if entry is not None else None
        if not runs or chunk != last:
            runs.append([])
        runs[-1].append(param)
        last = chunk
    return runs


def _parameters_to_vector_wrapper(
    wrapped: Any, instance: Any, args: tuple, kwargs: dict
) -> torch.Tensor:
    """``parameters_to_vector`` over offloaded parameters: each chunk is on the device while
    its params are read, one chunk at a time."""
    parameters: Iterable[torch.Tensor] = kwargs.get("parameters", args[0] if args else ())
    params = list(parameters)
    runtime = runtime_managing(params)
    if runtime is None:
        return wrapped(params)
    runtime.cpu_optim.early.check_no_early_read("torch.nn.utils.parameters_to_vector()")
    pieces = []
    for run in _runs_by_chunk(runtime, params):
        with params_on_device(runtime, run):
            pieces.append(wrapped(run))
    return torch.cat(pieces)


def _vector_to_parameters_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> None:
    """``vector_to_parameters`` into offloaded parameters: the values are written into their
    chunks (the params stay the chunks' views rather than views of ``vec``)."""
    vec: torch.Tensor = kwargs.get("vec", args[0] if args else None)
    parameters: Iterable[torch.Tensor] = kwargs.get("parameters", args[1] if len(args) > 1 else ())
    params = list(parameters)
    runtime = runtime_managing(params)
    if runtime is None or not isinstance(vec, torch.Tensor):
        return wrapped(vec, params)
    runtime.cpu_optim.early.check_no_early_read("torch.nn.utils.vector_to_parameters()")
    start = 0
    for run in _runs_by_chunk(runtime, params):
        count = sum(p.numel() for p in run)
        with params_on_device(runtime, run, written=run):
            wrapped(vec[start : start + count], run)
        start += count
    return None


def _update_parameters_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> None:
    """``AveragedModel.update_parameters(model)`` of an attached model reads its weights with
    every chunk on the device."""
    model = kwargs.get("model", args[0] if args else None)
    params = list(model.parameters()) if isinstance(model, nn.Module) else []
    runtime = runtime_managing(params)
    if runtime is None:
        return wrapped(*args, **kwargs)
    runtime.cpu_optim.early.check_no_early_read("AveragedModel.update_parameters()")
    with params_on_device(runtime, params):
        return wrapped(*args, **kwargs)


def _refuse_attached(model: Any) -> None:
    if isinstance(model, nn.Module) and registry.runtimes_in(model):
        raise AttachError(COMPILE_UNSUPPORTED)


def _compile_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``torch.compile(model)`` of an attached model: a clear error now, not an assertion deep
    in dynamo at the first forward."""
    _refuse_attached(kwargs.get("model", args[0] if args else None))
    return wrapped(*args, **kwargs)


def _module_compile_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    _refuse_attached(instance)
    return wrapped(*args, **kwargs)


def install(settings: Settings, target: str) -> None:
    _registry.wrap(nn.Module, "to", _to_wrapper, __name__)
    _registry.wrap(nn.Module, "cuda", _cuda_wrapper, __name__)
    _registry.wrap(nn.Module, "cpu", _cpu_wrapper, __name__)
    _registry.wrap(nn.Module, "_apply", _apply_wrapper, __name__)
    for method, dtype in _DTYPE_METHODS.items():
        _registry.wrap(nn.Module, method, _dtype_method_wrapper(dtype), __name__)
    _registry.wrap(nn.Module, "zero_grad", _zero_grad_wrapper, __name__)
    _registry.wrap(nn.Parameter, "__repr__", _param_repr_wrapper, __name__)
    # torch.nn.utils re-exports both functions: the module and the package name are patched.
    for owner in (torch.nn.utils, torch.nn.utils.convert_parameters):
        _registry.wrap(owner, "parameters_to_vector", _parameters_to_vector_wrapper, __name__)
        _registry.wrap(owner, "vector_to_parameters", _vector_to_parameters_wrapper, __name__)
    averaged = torch.optim.swa_utils.AveragedModel
    _registry.wrap(averaged, "update_parameters", _update_parameters_wrapper, __name__)
    _registry.wrap(torch, "compile", _compile_wrapper, __name__)
    _registry.wrap(nn.Module, "compile", _module_compile_wrapper, __name__)


def uninstall() -> None:
    _registry.restore_group(__name__)
