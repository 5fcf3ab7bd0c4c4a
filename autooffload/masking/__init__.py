"""Assistant-only loss masking: role boundaries per chat template, a vectorised scanner, labels.

This package imports nothing from the rest of autooffload but ``errors`` and ``log``; the patches
in ``autooffload.patches.hf_collators`` apply it to the collators and processors people use.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, TextIO

import torch

from autooffload.masking.boundaries import MaskingOptions, RoleBoundary, Scanner, ScanResult, Turn
from autooffload.masking.labels import IGNORE_INDEX, LabelMasker, MaskerCache, MaskingStats
from autooffload.masking.templates import FAMILIES, FAMILY_NAMES, detect_family, tokenizer_of

__all__ = [
    "FAMILIES",
    "FAMILY_NAMES",
    "IGNORE_INDEX",
    "LabelMasker",
    "MaskerCache",
    "MaskingOptions",
    "MaskingStats",
    "RoleBoundary",
    "ScanResult",
    "Scanner",
    "Turn",
    "detect_family",
    "explain",
]

_ON, _OFF = "\033[1;32m", "\033[0m"


def explain(
    tokenizer: Any,
    conversation: Sequence[dict[str, Any]] | str | Sequence[int],
    *,
    roles_to_train: Sequence[str] = ("assistant",),
    train_on_inputs: bool = False,
    train_on_eos: str = "turn",
    role_boundaries: Sequence[dict[str, Any]] | None = None,
    color: bool | None = None,
    file: TextIO | None = None,
) -> str:
    """Print ``conversation`` as the model sees it with the trained spans highlighted, and
    return that text.

    ``conversation`` is a list of messages (rendered with the tokenizer's chat template), the
    rendered text, or token ids. Trained spans are green with ``color`` (default: when ``file``
    is a terminal), else wrapped in ``[[`` ``]]``.
    """
    file = file if file is not None else sys.stdout
    options = MaskingOptions(train_on_inputs, tuple(roles_to_train), train_on_eos)
    cache = MaskerCache(options, role_boundaries)
    masker = cache.get(tokenizer)
    text_tokenizer = tokenizer_of(tokenizer)
    if isinstance(conversation, str):
        ids = text_tokenizer(conversation, add_special_tokens=False)["input_ids"]
    elif conversation and isinstance(conversation[0], dict):
        text = tokenizer.apply_chat_template(list(conversation), tokenize=False)
        ids = text_tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = list(conversation)  # type: ignore[arg-type]
    input_ids = torch.tensor([ids], dtype=torch.long)
    labels = masker.mask(input_ids, count=False) if masker is not None else None
    trained = [False] * len(ids) if labels is None else (labels[0] != IGNORE_INDEX).tolist()
    if color is None:
        color = bool(getattr(file, "isatty", lambda: False)())
    on, off = (_ON, _OFF) if color else ("[[", "]]")
    pieces, start = [], 0
    for index in range(1, len(ids) + 1):
        if index == len(ids) or trained[index] != trained[start]:
            segment = text_tokenizer.decode(ids[start:index])
            pieces.append(f"{on}{segment}{off}" if trained[start] else segment)
            start = index
    header = f"# masking: {masker.family if masker else 'unknown template (nothing masked)'}"
    shown = header + "\n" + "".join(pieces)
    print(shown, file=file)
    return shown
