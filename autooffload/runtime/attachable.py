"""Which models and model changes the runtime refuses: dispatched, meta, sharded, altered,
sparse gradients."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from autooffload.errors import AttachError

if TYPE_CHECKING:
    from autooffload.runtime.runtime import Runtime


COMPILE_UNSUPPORTED = (
    "torch.compile of a model attached by autooffload is not supported: its offload hooks and"
    " per-block activation checkpoints do not trace. Train without compiling the model (HF"
    " Trainer: torch_compile=False), compile only submodules autooffload does not manage, or"
    " set AUTOOFFLOAD_OFFLOAD=0"
)


def is_compiled(model: nn.Module) -> bool:
    """``torch.compile(model)``'s wrapper, or a module compiled in place (``model.compile()``)."""
    compiled = type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod")
    return compiled or getattr(model, "_compiled_call_impl", None) is not None


def check_attachable(model: nn.Module) -> None:
    """Refuse models autooffload must not manage (already sharded, dispatched, meta, compiled,
    or training an embedding with sparse gradients)."""
    if any(is_compiled(m) for m in model.modules()):
        raise AttachError(COMPILE_UNSUPPORTED)
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if (
            isinstance(module, (nn.Embedding, nn.EmbeddingBag))
            and module.sparse
            and isinstance(weight, nn.Parameter)
            and weight.requires_grad
        ):
            raise AttachError(
                f"{name or 'the model'} is a trainable {type(module).__name__} with sparse=True;"
                " autooffload offloads and updates dense gradients only: build it with"
                " sparse=False (with a dense optimizer such as AdamW instead of SparseAdam),"
                " freeze it, or set AUTOOFFLOAD_OFFLOAD=0"
            )
    if getattr(model, "hf_device_map", None) and len(set(model.hf_device_map.values())) > 1:
        raise AttachError(
            "model is dispatched across devices with device_map; autooffload's weight offload"
            " does not compose with it: load it without device_map or set AUTOOFFLOAD_OFFLOAD=0"
        )
    for param in model.parameters():
        if param.device.type == "meta":
            raise AttachError(
                "model has parameters on the meta device; load its weights before attaching"
                " (or set AUTOOFFLOAD_OFFLOAD=0)"
            )
        if type(param).__name__ == "DTensor" or hasattr(param, "_local_tensor"):
            raise AttachError(
                "model is sharded with FSDP2/DTensor; use FSDP2's CPUOffloadPolicy for weights"
                " (autooffload keeps activation management and masking), or set"
                " AUTOOFFLOAD_OFFLOAD=0"
            )


def check_params_after_attach(runtime: Runtime) -> None:
    """Refuse, at the next forward, parameter changes made after attach that would train
    wrongly: a parameter off the compute device, or a chunked parameter that was frozen at
    attach (it has no host gradient buffer) and now requires grad. A parameter added on the
    compute device trains like a resident one (the user's optimizer updates it there)."""
    for name, param in runtime.model.named_parameters():
        entry = runtime.slot_index.get(id(param))
        if entry is None:
            if param.device != runtime.device and not any(
                p is param for p in runtime.resident_params
            ):
                raise AttachError(
                    f"parameter {name} was added to the attached model on {param.device},"
                    f" not on its compute device {runtime.device}; create it on"
                    f" {runtime.device} (or move it there) before the next forward, add it"
                    " before the model is moved, or set AUTOOFFLOAD_OFFLOAD=0"
                )
            continue
        chunk, slot = entry
        if (
            param.requires_grad
            and chunk.index not in runtime.manager.persistent
            and not runtime.manager.grads.stages(param)
            and id(param) not in runtime.cpu_optim.offloaded_ids
        ):
            frozen_model = (
                " (the whole model was frozen then: AUTOOFFLOAD_OFFLOAD_FROZEN=0 keeps such"
                " models off the offload)"
                if runtime.attached_frozen
                else ""
            )
            raise AttachError(
                f"parameter {slot.name} was frozen when the model was attached and now"
                " requires grad, but its offloaded chunk has no host gradient buffer or"
                " optimizer state; unfreeze it before moving the model to the device,"
                f" detach first (model.cpu()), or set AUTOOFFLOAD_OFFLOAD=0{frozen_model}"
            )


DEEPCOPY_UNSUPPORTED = (
    "copy.deepcopy of a model attached by autooffload is not supported: its offloaded"
    " parameters have no device storage between uses, and its hooks hold the runtime. For a"
    " reference or EMA copy, copy the model before moving it to the device, or build a new"
    " model and load_state_dict(model.state_dict()) into it"
)
PICKLE_UNSUPPORTED = (
    "pickling or copy.copy of a model attached by autooffload (torch.save(model)) is not"
    " supported: its hooks hold the runtime. Save model.state_dict() (or save_pretrained), which"
    " reads every weight wherever it lives"
)


def _refuse_deepcopy(memo: dict) -> None:
    raise AttachError(DEEPCOPY_UNSUPPORTED)


def _refuse_pickle(protocol: int) -> None:
    raise AttachError(PICKLE_UNSUPPORTED)


# Instance attributes: copy.deepcopy and pickle look them up on the object.
_GUARDS = {"__deepcopy__": _refuse_deepcopy, "__reduce_ex__": _refuse_pickle}


def install_copy_guard(model: nn.Module) -> None:
    """``copy.deepcopy`` or pickling of the attached model or any module in it raises a clear
    error (a deepcopy read released storage and crashed the process; pickling failed on a
    hook's lambda or the runtime's lock)."""
    for module in model.modules():
        module.__dict__.update(_GUARDS)


def remove_copy_guard(model: nn.Module) -> None:
    for module in model.modules():
        for name, guard in _GUARDS.items():
            if module.__dict__.get(name) is guard:
                del module.__dict__[name]
