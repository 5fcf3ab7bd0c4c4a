"""Values on the bench's command line: sizes and caps (and a cap's label), sequence lengths,
KEY=VALUE options."""

from __future__ import annotations

import re
from typing import Any

GiB = 1 << 30

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_size(text: str) -> int | None:
    """Bytes from ``12GiB``, ``12GB``, ``12000MB``, ``1073741824``; None for ``none``/``off``."""
    value = text.strip()
    if value.lower() in ("", "none", "off", "nocap", "uncapped"):
        return None
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)", value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"invalid size {text!r}; use e.g. 12GiB, 12GB, 12000MB, 1073741824 or none"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_caps(text: str | None) -> list[int | None]:
    """A comma list of caps (``8GiB,12GiB,none``); ``None`` text means one uncapped run."""
    if text is None:
        return [None]
    return [parse_size(part) for part in text.split(",")]


def parse_seqs(text: str | None) -> list[int] | None:
    """A comma list of sequence lengths (``8192`` or ``8192,16384,32768``), each its own set of
    runs; ``None`` text: the workload's own length. Raises ValueError naming ``--seq``."""
    if text is None:
        return None
    parts = [part.strip() for part in text.split(",")]
    valid = "use positive integers, e.g. 8192 or 8192,16384,32768"
    seqs = []
    for part in parts:
        if not re.fullmatch(r"[0-9]+", part) or int(part) < 1:
            raise ValueError(f"invalid --seq {text!r}: {part!r} is not a positive integer; {valid}")
        if int(part) in seqs:
            raise ValueError(f"invalid --seq {text!r}: {part} is given twice; {valid}")
        seqs.append(int(part))
    return seqs


def cap_label(cap: int | None) -> str:
    """How tables and results name a cap: ``12GiB``, ``1500000000B``, ``none``."""
    if cap is None:
        return "none"
    gib = cap / GiB
    return f"{gib:g}GiB" if abs(gib - round(gib, 2)) < 1e-9 else f"{cap}B"


def parse_value(text: str) -> Any:
    """``4`` -> 4, ``0.5`` -> 0.5, ``true`` -> True, ``none`` -> None, else the string."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.strip()


def parse_options(items: list[str]) -> dict[str, Any]:
    """``["n_persist=4", "n_buffer=2"]`` -> ``{"n_persist": 4, "n_buffer": 2}``."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"invalid option {item!r}; expected KEY=VALUE (e.g. n_persist=4)")
        options[key.strip()] = parse_value(value)
    return options
