"""Patches transformers / TRL collators, processors and causal-LM forwards to mask chat labels.

Where labels are built, the batch goes through ``autooffload.masking``: trained roles keep their
labels, everything else (and pad and media placeholder tokens) becomes -100. The places:

- transformers ``DataCollatorForLanguageModeling`` (causal mode), ``DataCollatorForSeq2Seq`` and
  ``DataCollatorWithPadding`` (when the features carry token-level labels), and
  ``DataCollatorWithFlattening`` (packed rows, one sequence per restart of the position ids);
- TRL's ``DataCollatorForLanguageModeling`` and ``DataCollatorForVisionLanguageModeling``
  (``trl.trainer.sft_trainer``); ``SFTTrainer.__init__`` tells the text collator, which holds only
  a pad id, which tokenizer made its batches;
- ``ProcessorMixin.__call__`` (and each processor class's own ``__call__``, wrapped when the first
  instance is built) when a processor returns labels; ``apply_chat_template`` of tokenizers and
  processors, whose ``{% generation %}`` assistant mask is cross-checked against the scanner;
- the ``forward`` of every causal-LM / conditional-generation class, for hand-written
  ``collate_fn``'s that set ``labels = input_ids.clone()``. ``forward`` of the concrete class is
  the narrowest point that sees both ``input_ids`` and ``labels`` and that every call path reaches
  (``model(...)``, Trainer, PEFT's ``base_model.model.forward(...)``); wrapping
  ``nn.Module.__call__`` would tax every submodule, and the loss function never sees the input
  ids. Classes are found among the loaded subclasses of ``PreTrainedModel`` at install time, and
  from ``PreTrainedModel.post_init`` for classes built later, so nothing is imported to find
  them; every wrap goes through the registry and ``disable()`` restores them all;
- ``Trainer._get_num_items_in_batch``, so the loss normaliser counts the masked labels of
  batches a hand-written collate_fn made (otherwise the forward masks after the count).

Batches without chat markers (plain text) are left untouched; see ``autooffload.masking``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, MutableMapping, Sized
from dataclasses import dataclass
from typing import Any

import torch

from autooffload.log import logger, warn_once
from autooffload.masking import IGNORE_INDEX, MaskerCache, MaskingOptions
from autooffload.masking.labels import LabelMasker
from autooffload.patches import _registry

TARGETS: tuple[str, ...] = ("transformers", "transformers.trainer", "trl.trainer.sft_trainer")

_LM_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")


class _MaskingSession:
    """The state of one enable(): the masker cache, and which tokenizer made which batches."""

    def __init__(self, settings: Any) -> None:
        options = MaskingOptions(
            train_on_inputs=bool(settings.train_on_inputs),
            roles_to_train=tuple(settings.roles_to_train),
            train_on_eos=settings.train_on_eos,
        )
        self.cache = MaskerCache(options, settings.role_boundaries)
        self._last_seen: Callable[[], Any] = lambda: None
        self._owners: dict[int, tuple[Any, Any]] = {}
        self.masked_labels = _TensorIdSet()
        self.hooked_classes: set[type] = set()
        self.announced = False

    def announce(self, masker: LabelMasker, before: torch.Tensor, after: torch.Tensor) -> None:
        """One INFO line, at the first batch whose labels masking changed: which template and
        roles, the share of label tokens kept, and how to turn it off. Nothing otherwise."""
        if self.announced or after.shape != before.shape or torch.equal(after, before):
            return
        self.announced = True
        options = self.cache.options
        total = int((before != IGNORE_INDEX).sum())
        kept = int((after != IGNORE_INDEX).sum())
        share = f" ({100 * kept / total:.0f}%)" if total else ""
        logger.info(
            "masking: %s chat template, training on %s turns only (train_on_eos=%s): the first"
            " masked batch keeps %d of %d label tokens%s; AUTOOFFLOAD_MASK=0 trains on every"
            " token",
            masker.family,
            "/".join(options.roles_to_train),
            options.train_on_eos,
            kept,
            total,
            share,
        )

    def saw(self, tokenizer_or_processor: Any) -> None:
        """Remember the tokenizer or processor used last (for batches built by hand)."""
        try:
            self._last_seen = weakref.ref(tokenizer_or_processor)
        except TypeError:
            pass

    def bind(self, collator: Any, tokenizer_or_processor: Any) -> None:
        """Remember that ``collator``'s batches come from ``tokenizer_or_processor``."""
        try:
            self._owners[id(collator)] = (
                weakref.ref(collator),
                weakref.ref(tokenizer_or_processor),
            )
        except TypeError:
            pass

    def carry(self, collate_fn: Any) -> CarriedSources:
        """What a DataLoader worker started afresh needs to find the sources ``collate_fn``'s
        batches come from: the bindings of ``collate_fn`` and of the collators it holds as
        attributes (HF Trainer's ``RemoveColumnsCollator``), and the tokenizer used last."""
        held = [collate_fn, *getattr(collate_fn, "__dict__", {}).values()]
        bindings = []
        for collator in held:
            bound = self._owners.get(id(collator))
            if bound is not None and bound[0]() is collator and bound[1]() is not None:
                bindings.append((collator, bound[1]()))
        return CarriedSources(tuple(bindings), self._last_seen())

    def adopt(self, carried: CarriedSources) -> None:
        """Take the bindings and the last used tokenizer ``carry`` gave (in a worker)."""
        for collator, source in carried.bindings:
            self.bind(collator, source)
        if carried.last_seen is not None and self._last_seen() is None:
            self.saw(carried.last_seen)

    def source_of(self, collator: Any = None, fallback: Any = None) -> Any:
        """The processor or tokenizer behind ``collator``'s batches, else ``fallback``, else the
        last one used."""
        if collator is not None:
            for attr in ("processor", "tokenizer", "processing_class"):
                found = getattr(collator, attr, None)
                if found is not None and callable(found):
                    return found
            bound = self._owners.get(id(collator))
            if bound is not None and bound[0]() is collator and bound[1]() is not None:
                return bound[1]()
        return fallback if fallback is not None else self._last_seen()

    def masker(self, source: Any) -> LabelMasker | None:
        return None if source is None else self.cache.get(source)

    def mask_batch(
        self,
        batch: Any,
        source: Any,
        count: bool = True,
        labels_match_ids: bool = False,
        pads_by_attention: bool = False,
    ) -> None:
        """Replace ``batch["labels"]`` by its masked copy, in place of the mapping's entry
        (``labels_match_ids``: see ``LabelMasker.mask``). ``pads_by_attention``: the collator
        made the labels as the ids with every pad id -100 (transformers' causal-LM collator),
        which with pad = eos drops every end marker; chat rows are masked from the ids with
        pads taken from the attention mask instead, so trained end markers keep their labels.
        Rows without chat keep the collator's labels."""
        if not isinstance(batch, MutableMapping) or source is None:
            return
        labels, input_ids = batch.get("labels"), batch.get("input_ids")
        if labels is None or input_ids is None:
            return
        masker = self.masker(source)
        if masker is None:
            return
        as_numpy = not isinstance(labels, torch.Tensor)
        try:
            labels_t, ids_t = torch.as_tensor(labels), torch.as_tensor(input_ids)
        except (TypeError, ValueError, RuntimeError):
            return  # ragged lists: not a padded batch
        attention = batch.get("attention_mask")
        attention_t = None if attention is None else torch.as_tensor(attention)
        positions = batch.get("position_ids")
        positions_t = None if positions is None else torch.as_tensor(positions)
        collated = labels_t
        if pads_by_attention and attention_t is not None and attention_t.shape == ids_t.shape:
            labels_t = ids_t.masked_fill(attention_t == 0, -100)
            labels_match_ids = True
        masked = masker.mask(
            ids_t,
            labels_t,
            attention_mask=attention_t,
            count=count,
            labels_match_ids=labels_match_ids,
            position_ids=positions_t,
        )
        if masked is None or masked is labels_t:
            return
        if labels_t is not collated and masked.dim() == 2:
            chat_rows = (masked != labels_t).any(dim=1, keepdim=True)
            masked = torch.where(chat_rows, masked, collated)
        self.announce(masker, collated, masked)
        self.masked_labels.add(masked)
        batch["labels"] = masked.numpy() if as_numpy else masked


_session: _MaskingSession | None = None


@dataclass(frozen=True)
class CarriedSources:
    """Which tokenizer or processor made which collator's batches, sent to a DataLoader worker
    in the same pickle as its collate_fn, so the collators there are the bound objects."""

    bindings: tuple[tuple[Any, Any], ...]
    last_seen: Any


def carry(collate_fn: Any) -> CarriedSources | None:
    """The sources a worker collating with ``collate_fn`` needs; None while masking is off."""
    return None if _session is None else _session.carry(collate_fn)


def adopt(carried: CarriedSources) -> None:
    """Bind the carried collators to their sources in this process (a DataLoader worker)."""
    if _session is not None:
        _session.adopt(carried)


class _TensorIdSet:
    """Tensors seen, by identity: a WeakSet would compare tensors by value (and raise)."""

    def __init__(self) -> None:
        self._ids: set[int] = set()

    def add(self, tensor: torch.Tensor) -> None:
        key = id(tensor)
        if key not in self._ids:
            self._ids.add(key)
            weakref.finalize(tensor, self._ids.discard, key)

    def __contains__(self, tensor: object) -> bool:
        return id(tensor) in self._ids


def install(settings: Any, target: str) -> None:
    """Wrap the collators / processors / model forwards of ``target`` (mask=False: nothing)."""
    global _session
    if not getattr(settings, "mask", True):
        return
    if _session is None:
        _session = _MaskingSession(settings)
    if target == "transformers":
        _install_transformers()
    elif target == "transformers.trainer":
        from transformers.trainer import Trainer

        if hasattr(Trainer, "_get_num_items_in_batch"):
            _wrap(Trainer, "_get_num_items_in_batch", _count_items_wrapper)
    elif target == "trl.trainer.sft_trainer":
        from trl.trainer import sft_trainer

        wrappers = {
            "DataCollatorForLanguageModeling": _trl_lm_collator_wrapper,
            "DataCollatorForVisionLanguageModeling": _collator_wrapper,
        }
        for name, wrapper in wrappers.items():
            collator = getattr(sft_trainer, name, None)
            if collator is not None:
                _wrap(collator, "torch_call", wrapper)
        if hasattr(sft_trainer, "SFTTrainer"):
            _wrap(sft_trainer.SFTTrainer, "__init__", _sft_trainer_init_wrapper)


def uninstall() -> None:
    """Restore every wrapped attribute; log the all -100 sample count if there was one."""
    global _session
    _registry.restore_group(__name__)
    if _session is not None and _session.cache.stats.all_masked:
        stats = _session.cache.stats
        logger.info(
            "masking: %d of %d chat samples had every label -100", stats.all_masked, stats.samples
        )
    _session = None


def stats() -> tuple[int, int] | None:
    """(chat samples masked, of which with every label -100) of the current enable, or None."""
    if _session is None:
        return None
    return _session.cache.stats.samples, _session.cache.stats.all_masked


def _wrap(owner: Any, attr: str, wrapper: Callable[..., Any]) -> None:
    _registry.wrap(owner, attr, wrapper, group=__name__)


def _install_transformers() -> None:
    from transformers import data, modeling_utils, processing_utils, tokenization_utils_base

    collators = data.data_collator
    _wrap(collators.DataCollatorForLanguageModeling, "torch_call", _collator_wrapper)
    _wrap(collators.DataCollatorForLanguageModeling, "numpy_call", _collator_wrapper)
    _wrap(collators.DataCollatorForSeq2Seq, "__call__", _collator_wrapper)
    _wrap(collators.DataCollatorWithPadding, "__call__", _collator_wrapper)
    if hasattr(collators, "DataCollatorWithFlattening"):
        _wrap(collators.DataCollatorWithFlattening, "__call__", _collator_wrapper)

    tokenizer_base = tokenization_utils_base.PreTrainedTokenizerBase
    _wrap(tokenizer_base, "__call__", _tokenizer_call_wrapper)
    _wrap(tokenizer_base, "apply_chat_template", _chat_template_wrapper)

    processor_base = processing_utils.ProcessorMixin
    _wrap(processor_base, "__call__", _processor_call_wrapper)
    _wrap(processor_base, "apply_chat_template", _chat_template_wrapper)
    _wrap(processor_base, "__init__", _processor_init_wrapper)
    for processor_class in _subclasses(processor_base):
        _hook_processor_class(processor_class)

    model_base = modeling_utils.PreTrainedModel
    _wrap(model_base, "post_init", _post_init_wrapper)
    for model_class in _subclasses(model_base):
        _hook_model_class(model_class)


def _subclasses(base: type) -> list[type]:
    found, todo = [], list(base.__subclasses__())
    while todo:
        klass = todo.pop()
        found.append(klass)
        todo.extend(klass.__subclasses__())
    return found


def _defining_class(klass: type, attr: str) -> type | None:
    return next((k for k in klass.__mro__ if attr in k.__dict__), None)


def _hook_processor_class(processor_class: type) -> None:
    from transformers.processing_utils import ProcessorMixin

    owner = _defining_class(processor_class, "__call__")
    if owner is not None and owner is not ProcessorMixin and issubclass(owner, ProcessorMixin):
        _wrap(owner, "__call__", _processor_call_wrapper)


def _hook_model_class(model_class: type) -> None:
    session = _session
    if session is None or model_class in session.hooked_classes:
        return
    session.hooked_classes.add(model_class)
    if not model_class.__name__.endswith(_LM_SUFFIXES):
        return
    owner = _defining_class(model_class, "forward")
    if owner is not None and owner.__module__.startswith("transformers.models."):
        _wrap(owner, "forward", _forward_wrapper)


# --- wrappers: each runs the original first and masks what it returned ---


def _collator_wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    batch = wrapped(*args, **kwargs)
    session = _session
    if session is not None and not getattr(instance, "mlm", False):
        # transformers' causal-LM collator labels ids with pad ids -100 (every eos, pad = eos)
        lm = type(instance).__name__ == "DataCollatorForLanguageModeling"
        session.mask_batch(batch, session.source_of(instance), pads_by_attention=lm)
    return batch


def _trl_lm_collator_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any
) -> Any:
    batch = wrapped(*args, **kwargs)
    session = _session
    if session is not None:
        examples = args[0] if args else kwargs.get("examples")
        match = trl_labels_match_ids(instance, examples)
        session.mask_batch(batch, session.source_of(instance), labels_match_ids=match)
    return batch


def trl_labels_match_ids(collator: Any, examples: Any) -> bool:
    """True when TRL's language-modeling collator builds the labels as the ids padded with -100
    where the attention mask is 0: no example brings labels, or a completion / assistant mask
    that older TRL versions apply in the collator, and the batch is padded (not padding-free,
    where sequence starts are -100 too). Checked on the examples, not the batch, so the masker
    can skip comparing labels with ids."""
    if getattr(collator, "padding_free", False) or not isinstance(examples, list):
        return False
    return all(
        isinstance(example, Mapping) and not _LABEL_SOURCES.intersection(example)
        for example in examples
    )


# Example keys from which TRL's collators make labels other than the padded ids.
_LABEL_SOURCES = frozenset({"labels", "completion_mask", "assistant_masks"})


def _sft_trainer_init_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any
) -> Any:
    result = wrapped(*args, **kwargs)
    session = _session
    source = getattr(instance, "processing_class", None)
    if session is not None and source is not None:
        session.bind(getattr(instance, "data_collator", None), source)
        session.saw(source)
        _warn_if_packing_cuts_chats(session, instance, source)
    return result


# TRL packing strategies that cut sequences into pieces (``bfd`` truncates them instead).
_CUTTING_PACKING = frozenset({"wrapped", "bfd_split"})


def _warn_if_packing_cuts_chats(session: _MaskingSession, trainer: Any, source: Any) -> None:
    """One warning when TRL packs chat sequences by cutting them into pieces: a piece that holds
    no role marker reads as plain text and keeps every label, user text included."""
    args = getattr(trainer, "args", None)
    strategy = getattr(args, "packing_strategy", None)
    if not getattr(args, "packing", False) or strategy not in _CUTTING_PACKING:
        return
    dataset = getattr(trainer, "train_dataset", None)
    masker = session.masker(source)
    if masker is None or not isinstance(dataset, Sized) or len(dataset) == 0:
        return
    try:
        ids = torch.as_tensor(dataset[0]["input_ids"])
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError):
        return
    if ids.dim() != 1 or not bool(masker.scanner.scan(ids).has_chat.any()):
        return
    cut = "cuts every sequence" if strategy == "wrapped" else "cuts sequences over max_length"
    warn_once(
        "masking-packing-cuts-chats",
        f"masking: packing_strategy={strategy!r} {cut} into pieces, and a piece without a role"
        " marker is trained on every token, user text included: use packing_strategy='bfd'"
        " (which truncates instead), or AUTOOFFLOAD_MASK=0",
    )


def _tokenizer_call_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any
) -> Any:
    if _session is not None:
        _session.saw(instance)
    return wrapped(*args, **kwargs)


def _processor_init_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any
) -> Any:
    result = wrapped(*args, **kwargs)
    if _session is not None:
        _hook_processor_class(type(instance))
    return result


def _processor_call_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any
) -> Any:
    output = wrapped(*args, **kwargs)
    session = _session
    if session is not None:
        session.saw(instance)
        session.mask_batch(output, instance)
    return output


def _chat_template_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any
) -> Any:
    output = wrapped(*args, **kwargs)
    session = _session
    if session is None:
        return output
    session.saw(instance)
    if kwargs.get("return_assistant_tokens_mask") and isinstance(output, MutableMapping):
        _cross_check(session, instance, output)
    return output


def _cross_check(session: _MaskingSession, source: Any, output: MutableMapping) -> None:
    """Compare the template's ``{% generation %}`` mask with the scanner (warns on mismatch).
    A mask with no token set comes from a template without ``{% generation %}`` (transformers
    warns about that): there is nothing to compare."""
    masker = session.masker(source)
    ids, generation = output.get("input_ids"), output.get("assistant_masks")
    if masker is None or ids is None or generation is None or not _any_set(generation):
        return
    if not _is_nested(ids):
        ids, generation = [ids], [generation]
    try:
        ids_t, generation_t = torch.as_tensor(ids), torch.as_tensor(generation)
    except (TypeError, ValueError, RuntimeError):
        for row_ids, row_generation in zip(ids, generation):  # ragged: one sample at a time
            row_t = torch.as_tensor(list(row_ids))
            masker.mask(row_t, assistant_mask=torch.as_tensor(list(row_generation)), count=False)
        return
    attention = output.get("attention_mask")
    attention_t = None if attention is None else torch.as_tensor(attention).view(ids_t.shape)
    masker.mask(ids_t, attention_mask=attention_t, assistant_mask=generation_t, count=False)


def _any_set(mask: Any) -> bool:
    """Whether a (possibly nested or ragged) 0/1 mask has a 1."""
    if isinstance(mask, torch.Tensor):
        return bool(mask.any())
    return any(_any_set(item) if isinstance(item, (list, tuple)) else bool(item) for item in mask)


def _is_nested(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() == 2
    return bool(value) and isinstance(value[0], (list, tuple, torch.Tensor))


def _post_init_wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    result = wrapped(*args, **kwargs)
    _hook_model_class(type(instance))
    return result


def _forward_wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    session = _session
    labels = kwargs.get("labels")
    if (
        session is None
        or not isinstance(labels, torch.Tensor)
        or labels in session.masked_labels
        or getattr(getattr(instance, "config", None), "is_encoder_decoder", False)
    ):
        return wrapped(*args, **kwargs)
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    masker = session.masker(session.source_of())
    if not isinstance(input_ids, torch.Tensor) or masker is None:
        return wrapped(*args, **kwargs)
    attention_mask = kwargs.get("attention_mask")
    # Without an attention mask, position ids that restart inside a row mark packed sequences.
    positions = kwargs.get("position_ids") if attention_mask is None else None
    masked = masker.mask(
        input_ids,
        labels,
        attention_mask=attention_mask,
        count=False,
        position_ids=positions if isinstance(positions, torch.Tensor) else None,
    )
    if masked is not None and masked is not labels:
        changed = (masked != labels).any(-1)
        if bool(changed.any()):
            masker.count(masked.view(-1, masked.shape[-1]), changed.view(-1))
            session.announce(masker, labels, masked)
        session.masked_labels.add(masked)
        kwargs = {**kwargs, "labels": masked}
    return wrapped(*args, **kwargs)


def _count_items_wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    session = _session
    batches = kwargs.get("batch_samples", args[0] if args else None)
    if session is not None and isinstance(batches, list):
        source = session.source_of(
            getattr(instance, "data_collator", None),
            fallback=getattr(instance, "processing_class", None),
        )
        for batch in batches:
            labels = batch.get("labels") if isinstance(batch, MutableMapping) else None
            if isinstance(labels, torch.Tensor) and labels not in session.masked_labels:
                session.mask_batch(batch, source)
    return wrapped(*args, **kwargs)
