"""Built-in role boundaries per chat-template family, detection, and marker -> token-id resolution.

Markers are written as the text the chat template renders; ``resolve`` turns them into token ids
with the tokenizer at hand (``add_special_tokens=False``), so one table serves every tokenizer of a
family. A user override (``role_boundaries``) replaces the table wholesale and is checked here:
a marker that does not tokenize, tokenizes to nothing or to the unknown token is a SettingsError.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autooffload.errors import SettingsError
from autooffload.log import logger
from autooffload.masking.boundaries import RoleBoundary

Marker = str | Sequence[int]

EOS_MARKER = "eos_token"


@dataclass(frozen=True)
class BoundarySpec:
    """One boundary as text (or token ids): ``ends`` are alternatives; ``eos_token`` is the
    tokenizer's eos; no ends means the turn runs to the next start or the sequence end."""

    role: str
    start: Marker
    ends: tuple[Marker, ...] = ()
    include_start: bool = False
    include_end: bool = True


@dataclass(frozen=True)
class TemplateFamily:
    """A chat-template family: the strings that identify it and its boundaries."""

    name: str
    signature: tuple[str, ...]
    boundaries: tuple[BoundarySpec, ...]


def _per_role(roles: Sequence[str], start: str, ends: tuple[str, ...]) -> tuple[BoundarySpec, ...]:
    return tuple(BoundarySpec(role, start.format(role=role), ends) for role in roles)


# Order matters: a family whose signature contains another's (Phi-4 is ChatML plus <|im_sep|>)
# comes first.
FAMILIES: tuple[TemplateFamily, ...] = (
    TemplateFamily(
        "llama4",
        ("<|header_start|>", "<|eot|>"),
        _per_role(
            ("system", "user", "assistant", "ipython", "tool"),
            "<|header_start|>{role}<|header_end|>\n\n",
            ("<|eot|>", "<|eom|>"),
        ),
    ),
    TemplateFamily(
        "llama3",
        ("<|start_header_id|>", "<|eot_id|>"),
        _per_role(
            ("system", "user", "assistant", "ipython", "tool"),
            "<|start_header_id|>{role}<|end_header_id|>\n\n",
            ("<|eot_id|>", "<|eom_id|>"),
        ),
    ),
    TemplateFamily(
        "phi4",
        ("<|im_start|>", "<|im_sep|>"),
        _per_role(
            ("system", "user", "assistant", "tool"), "<|im_start|>{role}<|im_sep|>", ("<|im_end|>",)
        ),
    ),
    TemplateFamily(
        "chatml",
        ("<|im_start|>", "<|im_end|>"),
        _per_role(("system", "user", "assistant", "tool"), "<|im_start|>{role}\n", ("<|im_end|>",))
        # Qwen 2.5 / 3 render tool results inside a user turn; the longer marker wins there.
        + (BoundarySpec("tool", "<|im_start|>user\n<tool_response>", ("<|im_end|>",)),),
    ),
    TemplateFamily(
        "gemma",
        ("<start_of_turn>", "<end_of_turn>"),
        (
            BoundarySpec("system", "<start_of_turn>system\n", ("<end_of_turn>",)),
            BoundarySpec("user", "<start_of_turn>user\n", ("<end_of_turn>",)),
            BoundarySpec("assistant", "<start_of_turn>model\n", ("<end_of_turn>",)),
        ),
    ),
    TemplateFamily(
        "phi3",
        ("<|assistant|>", "<|end|>"),
        _per_role(("system", "user", "assistant"), "<|{role}|>\n", ("<|end|>",)),
    ),
    TemplateFamily(
        "mistral",
        ("[INST]", "[/INST]"),
        (
            BoundarySpec("system", "[SYSTEM_PROMPT]", ("[/SYSTEM_PROMPT]",)),
            # [/INST] ends the user turn and starts the answer: never trained as the user's end.
            BoundarySpec("user", "[INST]", ("[/INST]",), include_end=False),
            BoundarySpec("assistant", "[/INST]", (EOS_MARKER,)),
            BoundarySpec("tool", "[TOOL_RESULTS]", ("[/TOOL_RESULTS]",), include_end=False),
            BoundarySpec("assistant", "[/TOOL_RESULTS]", (EOS_MARKER,)),
        ),
    ),
)

FAMILY_NAMES = tuple(family.name for family in FAMILIES)

# Placeholder tokens a processor expands into image / video / audio features: never a target.
MEDIA_TOKENS = (
    "<|image_pad|>",
    "<|video_pad|>",
    "<|audio_pad|>",
    "<image_soft_token>",
    "<audio_soft_token>",
    "<video_soft_token>",
    "<|image|>",
    "<|video|>",
    "<|patch|>",
    "<IMG_CONTEXT>",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
)
_MEDIA_ATTRS = ("image_token_id", "video_token_id", "audio_token_id")
_MEDIA_TOKEN_ATTRS = ("image_token", "video_token", "audio_token")

_SPECIAL = re.compile(r"<\|[^|<>]+\|>|<[a-z_]+>|\[/?[A-Z_]+\]")


def tokenizer_of(obj: Any) -> Any:
    """The tokenizer of a tokenizer or a processor (its ``tokenizer`` attribute)."""
    inner = getattr(obj, "tokenizer", None)
    return inner if inner is not None and hasattr(inner, "encode") else obj


def chat_template_of(obj: Any) -> str | None:
    """The chat template text of a processor or tokenizer (named templates joined), or None."""
    for holder in (obj, tokenizer_of(obj)):
        template = getattr(holder, "chat_template", None)
        if isinstance(template, dict):
            template = "\n".join(str(t) for t in template.values())
        if isinstance(template, str) and template:
            return template
    return None


def single_token_id(tokenizer: Any, token: str) -> int | None:
    """The id of ``token`` if the vocabulary holds it as one token, else None."""
    try:
        token_id = tokenizer.convert_tokens_to_ids(token)
    except (KeyError, TypeError, ValueError):
        return None
    if not isinstance(token_id, int) or token_id < 0:
        return None
    unk = getattr(tokenizer, "unk_token_id", None)
    if token_id == unk and token != getattr(tokenizer, "unk_token", None):
        return None
    return token_id


def detect_family(obj: Any) -> TemplateFamily | None:
    """The family of a tokenizer or processor: from its chat template text, else from the
    special tokens of its vocabulary (a tokenizer shipped without a template); None if unknown."""
    template = chat_template_of(obj)
    if template is not None:
        for family in FAMILIES:
            if all(marker in template for marker in family.signature):
                return family
    tokenizer = tokenizer_of(obj)
    for family in FAMILIES:
        if all(single_token_id(tokenizer, marker) is not None for marker in family.signature):
            return family
    return None


def specs_from_settings(role_boundaries: Sequence[dict[str, Any]]) -> tuple[BoundarySpec, ...]:
    """User ``role_boundaries`` dicts as specs (``end`` null -> no end marker)."""
    specs = []
    for item in role_boundaries:
        end = item.get("end")
        specs.append(
            BoundarySpec(
                role=item["role"],
                start=item["start"],
                ends=() if end is None else (end,),
                include_start=bool(item.get("include_start", False)),
                include_end=bool(item.get("include_end", True)),
            )
        )
    return tuple(specs)


def check_markers_without_tokenizer(role_boundaries: Sequence[dict[str, Any]]) -> None:
    """The checks of ``role_boundaries`` that need no tokenizer (run at enable time)."""
    for index, item in enumerate(role_boundaries):
        for key in ("start", "end"):
            marker = item.get(key)
            if marker is None and key == "end":
                continue
            where = f"role_boundaries[{index}].{key}"
            if isinstance(marker, str):
                if not marker.strip() and marker not in ("\n", "\n\n"):
                    raise SettingsError(
                        f"{where}={marker!r} is empty or blank and would match nothing; "
                        "give the exact text the chat template renders, or its token ids"
                    )
            elif not marker or any(not isinstance(t, int) or t < 0 for t in marker):
                raise SettingsError(
                    f"{where}={marker!r} must be a non-empty string or list of token ids >= 0"
                )


def resolve(
    tokenizer: Any, specs: Sequence[BoundarySpec], user_given: bool
) -> tuple[RoleBoundary, ...]:
    """Token-level boundaries for ``tokenizer``. A user-given marker that does not tokenize is a
    SettingsError naming it; a built-in one whose special tokens are absent drops its boundary."""
    boundaries = []
    for index, spec in enumerate(specs):
        try:
            start = _marker_ids(tokenizer, spec.start, index, "start", user_given)
        except _Absent as absent:
            logger.debug("masking: boundary %s skipped, %s is not in the vocabulary", spec, absent)
            continue
        ends = []
        for end in spec.ends:
            try:
                ends.append(_marker_ids(tokenizer, end, index, "end", user_given))
            except _Absent:
                continue  # one end alternative (e.g. <|eom_id|>) missing from this vocabulary
        if spec.ends and not ends:
            continue
        merges = whitespace_merges(tokenizer, start[-1]) if len(start) > 1 else ()
        boundaries.append(
            RoleBoundary(
                spec.role, (start,), tuple(ends), spec.include_start, spec.include_end, merges
            )
        )
    return tuple(boundaries)


_MERGES: dict[tuple[str, int, int], tuple[int, ...]] = {}


def whitespace_merges(tokenizer: Any, token_id: int) -> tuple[int, ...]:
    """The ids of the tokens that are ``token_id``'s whitespace followed by more whitespace
    (``\\n`` -> ``\\n\\n``, ``\\n\\n\\n``, ``\\n  \\n``, ...): what the tokenizer makes
    of a marker ending in ``\\n`` before content that opens with whitespace. Empty unless
    ``token_id`` is whitespace only. A merge's raw token begins with ``token_id``'s (byte-level
    BPE and SentencePiece merges concatenate), so only those are decoded; cached per vocabulary
    (one pass over it, ~0.1 s for 150k tokens)."""
    key = (str(getattr(tokenizer, "name_or_path", "")), len(tokenizer), int(token_id))
    if key[0] and key in _MERGES:
        return _MERGES[key]
    merges: tuple[int, ...] = ()
    needs = ("convert_ids_to_tokens", "get_vocab", "batch_decode")
    if not all(hasattr(tokenizer, name) for name in needs):
        # A tokenizer-like object without a vocabulary to read: the plain markers only.
        logger.debug("masking: %s has no vocabulary to read merges from", type(tokenizer))
        return merges
    text = tokenizer.decode([token_id])
    if text and not text.strip():
        raw = tokenizer.convert_ids_to_tokens(int(token_id))
        vocab = tokenizer.get_vocab()
        candidates = [i for token, i in vocab.items() if token.startswith(raw) and i != token_id]
        texts = tokenizer.batch_decode([[i] for i in candidates]) if candidates else []
        merges = tuple(
            sorted(
                i
                for i, t in zip(candidates, texts, strict=True)
                if t.startswith(text) and len(t) > len(text) and not t.strip()
            )
        )
    if key[0]:
        _MERGES[key] = merges
    return merges


class _Absent(Exception):
    """A built-in marker's special token is not in this vocabulary."""


def _marker_ids(
    tokenizer: Any, marker: Marker, index: int, key: str, user_given: bool
) -> tuple[int, ...]:
    where = f"role_boundaries[{index}].{key}"
    size = len(tokenizer)
    if marker == EOS_MARKER:
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            if not user_given:
                raise _Absent(EOS_MARKER)
            raise SettingsError(
                f"{where}='eos_token' but the tokenizer has no eos_token; "
                "give the end marker as text or token ids"
            )
        return (int(eos),)
    if not isinstance(marker, str):
        ids = tuple(int(t) for t in marker)
        bad = [t for t in ids if t >= size]
        if not ids or bad:
            raise SettingsError(
                f"{where}={list(marker)!r} has token ids outside the vocabulary (size {size}); "
                "use ids below the tokenizer's length, or the marker text"
            )
        return ids
    if not user_given:
        for special in _SPECIAL.findall(marker):
            if single_token_id(tokenizer, special) is None:
                raise _Absent(special)
    ids = tuple(tokenizer.encode(marker, add_special_tokens=False))
    unk = getattr(tokenizer, "unk_token_id", None)
    if not ids:
        raise SettingsError(
            f"{where}={marker!r} tokenizes to nothing with this tokenizer; give the exact text "
            "the chat template renders around the turn, or its token ids"
        )
    unk_text = getattr(tokenizer, "unk_token", None)
    if unk is not None and unk in ids and not (unk_text and unk_text in marker):
        raise SettingsError(
            f"{where}={marker!r} does not tokenize (it contains the unknown token); give text "
            "the tokenizer knows, or the marker's token ids"
        )
    return ids


def special_id_blocks(obj: Any) -> tuple[int, int | None]:
    """``(below, start)``: every id below ``below`` and every id from ``start`` to the end of the
    vocabulary is an added token of the tokenizer (special tokens, chat and media markers);
    ``(0, None)`` when the tokenizer does not list its added tokens."""
    tokenizer = tokenizer_of(obj)
    added = getattr(tokenizer, "added_tokens_decoder", None)
    try:
        size = len(tokenizer)
    except TypeError:
        return 0, None
    if not isinstance(added, dict) or not added:
        return 0, None
    below = 0
    while below in added:
        below += 1
    start = size
    while start - 1 in added:
        start -= 1
    return below, (start if start < size else None)


def media_token_ids(obj: Any) -> tuple[int, ...]:
    """Ids of the image / video / audio placeholder tokens of a processor or tokenizer."""
    tokenizer = tokenizer_of(obj)
    found: set[int] = set()
    for holder in (obj, tokenizer):
        for attr in _MEDIA_ATTRS:
            value = getattr(holder, attr, None)
            if isinstance(value, int) and value >= 0:
                found.add(value)
        for attr in _MEDIA_TOKEN_ATTRS:
            value = getattr(holder, attr, None)
            if isinstance(value, str):
                token_id = single_token_id(tokenizer, value)
                if token_id is not None:
                    found.add(token_id)
    for token in MEDIA_TOKENS:
        token_id = single_token_id(tokenizer, token)
        if token_id is not None:
            found.add(token_id)
    return tuple(sorted(found))
