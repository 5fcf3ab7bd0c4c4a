"""PEFT patches: tuner layer code (LoRA and every other PEFT tuner) that reads or writes base
weights outside a block's forward (merge, unmerge, delta weights, DoRA/PiSSA init, trainable
tokens, ``modules_to_save`` copies) runs with the owning chunks on the device, and merged bytes
are stored back to the host.

Inside a block's forward every chunk of the block is resident (the runtime's group hooks), so
``lora.Linear.forward`` and DoRA's magnitude path need nothing for their weights; an attached
layer's forward saves the fp32 upcast of its input (fp32 adapters on a bf16 base) as the bf16
input itself (``Settings.saved_upcasts``, ``runtime/activations/saved_upcasts.py``).
Everything else here runs outside one: ``merge_adapter()``, ``merge_and_unload()``,
``unmerge`` inside a ``disable_adapter()`` forward of a merged model, and adapter creation on
an already attached base.

``add_weighted_adapter`` reads the source adapters' weights directly, outside any layer method:
with adapters in chunks (trainable bytes over a tenth) the LoRA task-arithmetic combinations
hold each target layer's chunks while they read it; ``cat`` (and IA3's combination) read them
inline, so they are refused while those weights are in chunks. So is AdaLoRA with adapters in
chunks: it reads every adapter weight and gradient outside the blocks; and ``hotswap_adapter``
into an adapter in chunks, which writes its weights in place one by one.

``prepare_model_for_kbit_training`` on an attached model (a bitsandbytes model attached as
``from_pretrained`` loaded it, ``patches/transformers_loading.py``) freezes every param and
casts the bf16/fp16 ones that are not 4-bit codes to fp32 by replacing their ``.data``: a
layout change no chunk can follow. The model is detached for the call (its bytes come back to
ordinary host tensors), prepared as PEFT prepares it, and attached again on the same device
with the same settings; the plan is searched anew at its next forward.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from autooffload.errors import AttachError
from autooffload.patches import _registry
from autooffload.patches.torch_module import attach_suppressed
from autooffload.runtime.activations.saved_upcasts import register, saving_sources
from autooffload.runtime.attachable import install_copy_guard, remove_copy_guard
from autooffload.settings import Settings

TARGETS = ("peft",)

# Methods of PEFT tuner layers (LoRA, DoRA and every other tuner: IA3, LoHa, LoKr, VeRA, OFT,
# trainable tokens, ...) that read base weights; those in _WRITES also change them in place.
_READS = ("merge", "unmerge", "get_delta_weight", "update_layer")
_WRITES = ("merge", "unmerge", "update_layer")


def _subclasses(cls: type) -> Iterator[type]:
    """``cls`` and its subclasses, each once (tuner layers inherit from several bases)."""
    seen: set[type] = set()
    pending = [cls]
    while pending:
        current = pending.pop()
        if current not in seen:
            seen.add(current)
            yield current
            pending.extend(current.__subclasses__())


def _base_params(layer: nn.Module) -> list[nn.Parameter]:
    get_base_layer = getattr(layer, "get_base_layer", None)
    base = get_base_layer() if callable(get_base_layer) else layer
    return list(base.parameters())


def _layer_of(instance: Any, args: tuple) -> nn.Module | None:
    """The layer a wrapped LoRA method runs on. PEFT calls some through the class with a layer
    of another type as ``self`` (``ParamWrapper`` calls ``Linear.get_delta_weight(self)``), and
    wrapt then binds no instance: the layer is the first argument."""
    if instance is None:
        instance = args[0] if args else None
    return instance if isinstance(instance, nn.Module) else None


def _layer_wrapper(writes: bool) -> Callable[..., Any]:
    def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        from autooffload.runtime.access import params_on_device, runtime_managing

        instance = _layer_of(instance, args)
        if instance is None:
            return wrapped(*args, **kwargs)
        params = list(instance.parameters())
        runtime = runtime_managing(params)
        if runtime is None:
            return wrapped(*args, **kwargs)
        written = _base_params(instance) if writes else []
        name = getattr(wrapped, "__name__", "")
        if name in ("merge", "unmerge") and any(runtime.quantized.of(p) for p in written):
            # PEFT re-quantizes the merged weight into a new Params4bit/Int8Params: a param
            # no chunk holds, and the chunked original would be left behind.
            raise AttachError(
                f"{type(instance).__name__}.{name} on a bitsandbytes-quantized base layer is not"
                " supported while the model is attached; call autooffload.disable() (or"
                " model.cpu()) first, then merge"
            )
        with params_on_device(runtime, params, written):
            return wrapped(*args, **kwargs)

    return wrapper


def _forward_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """A tuner layer outside a block (lm_head, embeddings) is several groups: the base layer and,
    when adapters are chunked, each adapter module. DoRA reads the base weight after the base
    forward released it and calls the adapters twice; trainable tokens read the base embedding
    without calling its forward at all: hold every chunk of the layer through its forward
    (inside a block, where they are resident already, this costs a few lookups)."""
    from autooffload.runtime.access import params_on_device, runtime_managing

    layer = _layer_of(instance, args)
    if layer is None:
        return wrapped(*args, **kwargs)
    params = list(layer.parameters())
    runtime = runtime_managing(params)
    if runtime is None:
        return wrapped(*args, **kwargs)
    # The scope saves the upcasts ``_cast_input_wrapper`` registers (installed with
    # ``Settings.saved_upcasts``); without it, none is registered and the scope saves nothing.
    with params_on_device(runtime, params), saving_sources():
        return wrapped(*args, **kwargs)


def _cast_input_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``_cast_input_dtype`` inside an attached layer's forward: the upcast it makes (the input
    for an fp32 ``lora_A`` of a bf16 base) is saved for the backward as the input itself
    (``saved_upcasts``; the forward wrapper opened the scope)."""
    out = wrapped(*args, **kwargs)
    source = args[0] if args else kwargs.get("x")
    if isinstance(out, torch.Tensor) and isinstance(source, torch.Tensor):
        register(out, source)
    return out


def _inject_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """PEFT moves each new adapter to its base layer's device: that is no model to attach.
    Wraps adapter injection and each layer's move of its adapters (``update_layer`` called
    outside injection: EVA's data-driven init, AdaLoRA's rank changes)."""
    with attach_suppressed():
        return wrapped(*args, **kwargs)


@contextmanager
def _without_runtime_hooks(module: nn.Module, runtime: Any) -> Iterator[None]:
    """Take the runtime's hooks off ``module`` for the block. A deepcopy would carry them to
    the copy, and copy what their bound methods hold: the runtime with its released chunks."""
    hook_ids = runtime.hook_ids()
    saved: list[tuple[dict, dict]] = []
    for sub in module.modules():
        for name, hooks in vars(sub).items():
            if "hook" in name and isinstance(hooks, dict) and hook_ids & hooks.keys():
                saved.append((hooks, dict(hooks)))
                for key in hook_ids & hooks.keys():
                    del hooks[key]
    # The deepcopy guard too: with the bytes on the device and no hooks, this copy is safe.
    remove_copy_guard(module)
    try:
        yield
    finally:
        for hooks, snapshot in saved:
            hooks.clear()
            hooks.update(snapshot)
        install_copy_guard(module)


def _modules_to_save_update_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``ModulesToSaveWrapper.update`` deep-copies the original module: its bytes must be on the
    device for the copy, which then stays resident and is trained by the user's optimizer."""
    from autooffload.runtime.access import params_on_device, runtime_managing

    original = instance.original_module
    runtime = runtime_managing(original.parameters())
    if runtime is None:
        return wrapped(*args, **kwargs)
    with (
        attach_suppressed(),
        params_on_device(runtime, list(original.parameters())),
        _without_runtime_hooks(original, runtime),
    ):
        return wrapped(*args, **kwargs)


def _adapter_params(model: nn.Module, adapters: Iterable[str]) -> list[torch.Tensor]:
    """The params of ``adapters`` in every tuner layer of ``model`` (LoRA A/B, IA3 vectors...)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    params: list[torch.Tensor] = []
    for layer in model.modules():
        if not isinstance(layer, BaseTunerLayer):
            continue
        for attr in layer.adapter_layer_names:
            per_adapter = getattr(layer, attr, {})
            for adapter in adapters:
                if adapter not in per_adapter:
                    continue
                held = per_adapter[adapter]
                params.extend(held.parameters() if isinstance(held, nn.Module) else [held])
    return params


def _weighted_target_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``LoraModel._generalized_task_arithmetic_weighted_adapter`` reads the source adapters of
    one target layer: hold that layer's chunks while it does."""
    from autooffload.runtime.access import params_on_device, runtime_managing

    target = kwargs["target"] if "target" in kwargs else args[3]
    params = list(target.parameters())
    runtime = runtime_managing(params)
    if runtime is None:
        return wrapped(*args, **kwargs)
    with params_on_device(runtime, params):
        return wrapped(*args, **kwargs)


def _add_weighted_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Refuse the combinations that read chunked source adapters inline (no layer to hold)."""
    from peft.tuners.lora import LoraModel

    from autooffload.runtime.access import runtime_managing

    adapters = kwargs["adapters"] if "adapters" in kwargs else args[0]
    combination = kwargs.get("combination_type", args[3] if len(args) > 3 else "svd")
    per_layer = isinstance(instance, LoraModel) and combination != "cat"
    if not per_layer and runtime_managing(_adapter_params(instance.model, adapters)) is not None:
        name = f"combination_type={combination!r}" if isinstance(instance, LoraModel) else ""
        raise AttachError(
            f"{type(instance).__name__}.add_weighted_adapter({name}) reads adapter weights that"
            " are offloaded in chunks (the adapters are over a tenth of the model's bytes); call"
            " it before moving the model to the device or after autooffload.disable(), or use"
            " a LoRA combination_type other than 'cat'"
        )
    return wrapped(*args, **kwargs)


def _adalora_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """AdaLoRA reads every adapter weight after the model's forward (its orthogonal
    regularization) and every adapter gradient after the step (``update_and_allocate``), then
    masks ranks in place: none of which adapters offloaded in chunks support. Refused at the
    first forward (a ``PeftModel`` with a task type) or the first ``update_and_allocate``."""
    from autooffload.runtime.access import runtime_managing

    adapter = instance.trainable_adapter_name
    if runtime_managing(_adapter_params(instance.model, [adapter])) is not None:
        raise AttachError(
            "AdaLoRA with adapters offloaded in chunks (over a tenth of the model's bytes) is not"
            " supported: its orthogonal regularization and update_and_allocate read every adapter"
            " weight and gradient outside the blocks; lower init_r so that the adapters stay on"
            " the device, or use LoRA"
        )
    return wrapped(*args, **kwargs)


def _hotswap_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``hotswap_adapter`` writes the new weights into the adapter's params in place, one by
    one outside any forward: refused while they are offloaded in chunks."""
    from autooffload.runtime.access import runtime_managing

    model = kwargs["model"] if "model" in kwargs else args[0]
    adapter = kwargs["adapter_name"] if "adapter_name" in kwargs else args[2]
    if runtime_managing(_adapter_params(model, [adapter])) is not None:
        raise AttachError(
            f"hotswap_adapter into adapter {adapter!r}, whose weights are offloaded in chunks (the"
            " adapters are over a tenth of the model's bytes), is not supported while attached;"
            " call it after autooffload.disable(), or load the new adapter with load_adapter"
            " and switch with set_adapter"
        )
    return wrapped(*args, **kwargs)


def _prepare_kbit_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    from autooffload.runtime.access import call_detached, runtime_managing

    model = args[0] if args else kwargs.get("model")
    runtime = runtime_managing(model.parameters()) if isinstance(model, nn.Module) else None
    if runtime is None:
        return wrapped(*args, **kwargs)
    return call_detached(
        runtime,
        "prepare_model_for_kbit_training on an attached model after an optimizer was built"
        " over it is not supported: it replaces the parameters' data (fp32 casts); call it"
        " right after from_pretrained, before creating the optimizer or the Trainer",
        lambda: wrapped(*args, **kwargs),
    )


def install(settings: Settings, target: str) -> None:
    from peft.tuners.adalora import AdaLoraModel
    from peft.tuners.ia3 import IA3Model
    from peft.tuners.lora import LoraModel
    from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
    from peft.utils.hotswap import hotswap_adapter_from_state_dict
    from peft.utils.other import ModulesToSaveWrapper, prepare_model_for_kbit_training

    _registry.wrap(BaseTuner, "inject_adapter", _inject_wrapper, __name__)
    for method in ("forward", "update_and_allocate"):
        _registry.wrap(AdaLoraModel, method, _adalora_wrapper, __name__)
    _registry.wrap(ModulesToSaveWrapper, "update", _modules_to_save_update_wrapper, __name__)
    # Scripts import it by name, often before enable(): redirected, so every binding is caught.
    if isinstance(prepare_model_for_kbit_training, types.FunctionType):
        _registry.redirect(prepare_model_for_kbit_training, _prepare_kbit_wrapper, __name__)
    if isinstance(hotswap_adapter_from_state_dict, types.FunctionType):
        _registry.redirect(hotswap_adapter_from_state_dict, _hotswap_wrapper, __name__)
    _registry.wrap(
        LoraModel,
        "_generalized_task_arithmetic_weighted_adapter",
        _weighted_target_wrapper,
        __name__,
    )
    for cls in (LoraModel, IA3Model):
        _registry.wrap(cls, "add_weighted_adapter", _add_weighted_wrapper, __name__)
    for cls in _subclasses(BaseTunerLayer):
        for attr in _READS:
            if attr in cls.__dict__:
                _registry.wrap(cls, attr, _layer_wrapper(attr in _WRITES), __name__)
        if "_move_adapter_to_device_of_base_layer" in cls.__dict__:
            _registry.wrap(cls, "_move_adapter_to_device_of_base_layer", _inject_wrapper, __name__)
        if "forward" in cls.__dict__:
            _registry.wrap(cls, "forward", _forward_wrapper, __name__)
    if settings.saved_upcasts and "_cast_input_dtype" in BaseTunerLayer.__dict__:
        _registry.wrap(BaseTunerLayer, "_cast_input_dtype", _cast_input_wrapper, __name__)


def uninstall() -> None:
    _registry.restore_group(__name__)
