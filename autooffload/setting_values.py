"""Parsers of the settings' values (``settings.Settings`` names one per knob): each turns an env
string or a keyword value into the knob's type, or raises ``SettingsError`` naming the setting,
the value and what is valid."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from autooffload.errors import SettingsError

BOUNDARY_KEYS = ("role", "start", "end", "include_start", "include_end")
KNOWN_ROLES = ("system", "user", "assistant", "tool", "developer")
# ``Settings.chunk_pool``: the CUDA stream whose allocator pool holds chunk storage
# (runtime/chunks/store.py).
CHUNK_POOLS = ("compute", "copy")
ACCUMULATE_ON = ("cpu", "gpu")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_AUTO = ("auto", "none")

# Decimal units are SI (GB = 10**9); binary units and the bare letters are powers of two.
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {unit: 2 ** (10 * power) for power, unit in enumerate("kmgt", start=1)}
_UNITS |= {unit + "ib": 2 ** (10 * power) for power, unit in enumerate("kmgt", start=1)}
_SIZE_RE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)$")

_SIZE_TEXT = "a size such as 12GiB, 12GB, 12000MB or 1073741824 (bytes)"
_FRACTION_TEXT = "a fraction of the device in (0, 1] such as 0.5 (1 = the whole device)"
# Where a fraction is allowed, a bare number (no unit) is a fraction when in (0, 1] and a byte
# count from here up; anything between is refused: "AUTOOFFLOAD_BUDGET=8" meant 8 GiB, not
# 8 bytes. A size with a unit ("900KB") is taken as written.
MIN_BARE_BYTES = 1 << 20
_BARE_TEXT = (
    f"a bare number is a fraction in (0, 1] or a byte count >= {MIN_BARE_BYTES};"
    " give smaller sizes with a unit (e.g. 512KiB)"
)
_BOUNDARIES_TEXT = (
    "a JSON list of objects with keys role, start, end, include_start, include_end"
    " (start/end a string or a list of token ids, include_* true/false),"
    " or the path of a .json/.yaml file holding that list"
)


def fail(name: str, value: Any, valid: str) -> SettingsError:
    shown = repr(value)
    if len(shown) > 200:
        shown = shown[:197] + "..."
    return SettingsError(f"{name}={shown} is invalid; valid values: {valid}.")


def parse_bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    raise fail(name, value, "1/0, true/false, yes/no, on/off")


def parse_optional_bool(value: Any, name: str) -> bool | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in _AUTO):
        return None
    try:
        return parse_bool(value, name)
    except SettingsError:
        raise fail(name, value, "auto, 1/0, true/false, yes/no, on/off") from None


def parse_size(
    value: Any, name: str, *, fraction: bool, optional: bool, minimum: int = 1
) -> int | float | None:
    valid = _SIZE_TEXT + (f", {_FRACTION_TEXT}" if fraction else "")
    valid += ", or auto" if optional else ""
    if fraction:
        valid += f" ({_BARE_TEXT})"
    if value is None and optional:
        return None
    if isinstance(value, bool):
        raise fail(name, value, valid)
    if isinstance(value, int):
        # Typed: a byte count (sizes parsed from text arrive as ints too), 1 the whole device.
        if fraction and value == 1:
            return 1.0
        if value >= minimum:
            return value
        raise fail(name, value, valid)
    if isinstance(value, float):
        if fraction and 0.0 < value <= 1.0:
            return value
        raise fail(name, value, valid)
    if not isinstance(value, str):
        raise fail(name, value, valid)
    text = value.strip()
    if optional and text.lower() in _AUTO:
        return None
    match = _SIZE_RE.match(text)
    if match is None:
        raise fail(name, value, valid)
    number, unit = match.groups()
    if not unit:
        if "." in number:
            if fraction and 0.0 < float(number) <= 1.0:
                return float(number)
            raise fail(name, value, valid)
        return _bare_number(int(number), name, value, fraction=fraction, minimum=minimum)
    multiplier = _UNITS.get(unit.lower())
    if multiplier is None:
        raise fail(name, value, valid)
    n_bytes = round(float(number) * multiplier)
    # One byte would read back as the int 1, the whole device, where a fraction is allowed.
    if n_bytes < minimum or (fraction and n_bytes == 1):
        raise fail(name, value, valid)
    return n_bytes


def _bare_number(
    number: int, name: str, shown: Any, *, fraction: bool, minimum: int
) -> int | float:
    """An integer written without a unit: ``1`` is the whole device where a fraction is
    allowed, and a byte count there must reach ``MIN_BARE_BYTES``."""
    valid = _SIZE_TEXT + (f", {_FRACTION_TEXT} ({_BARE_TEXT})" if fraction else "")
    if fraction and number == 1:
        return 1.0
    if number < minimum or (fraction and number < MIN_BARE_BYTES):
        raise fail(name, shown, valid)
    return number


def parse_size_or_fraction(value: Any, name: str) -> int | float | None:
    return parse_size(value, name, fraction=True, optional=True)


def parse_optional_bytes(value: Any, name: str) -> int | None:
    return parse_size(value, name, fraction=False, optional=True)  # type: ignore[return-value]


def parse_threshold(value: Any, name: str) -> int:
    return parse_size(value, name, fraction=False, optional=False, minimum=0)  # type: ignore[return-value]


def parse_count(value: Any, name: str) -> int | None:
    valid = "an integer >= 0, or auto"
    if value is None:
        return None
    if isinstance(value, bool):
        raise fail(name, value, valid)
    if isinstance(value, int) and value >= 0:
        return value
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in _AUTO:
            return None
        if text.isdigit():
            return int(text)
    raise fail(name, value, valid)


def parse_threads(value: Any, name: str) -> int | None:
    count = parse_count(value, name)
    if count == 0:
        raise fail(name, value, "an integer >= 1, or auto")
    return count


def enum_of(choices: tuple[str, ...], optional: bool = False) -> Callable[[Any, str], str | None]:
    valid = ", ".join(choices) + (", or auto" if optional else "")

    def parse(value: Any, name: str) -> str | None:
        if value is None and optional:
            return None
        if isinstance(value, str):
            text = value.strip().lower()
            if optional and text == "auto":
                return None
            if text in choices:
                return text
        raise fail(name, value, valid)

    return parse


def parse_roles(value: Any, name: str) -> tuple[str, ...]:
    valid = f"a comma list or JSON list of role names such as {', '.join(KNOWN_ROLES)}"
    roles = value
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                roles = json.loads(text)
            except json.JSONDecodeError:
                raise fail(name, value, valid) from None
        else:
            roles = [part.strip() for part in text.split(",") if part.strip()]
    if not isinstance(roles, (list, tuple)):
        raise fail(name, value, valid)
    if not roles and isinstance(value, str) and not value.strip().startswith("["):
        raise fail(name, value, valid + ", or [] (JSON) to mask every role")
    if not all(isinstance(role, str) and role.strip() for role in roles):
        raise fail(name, value, valid)
    return tuple(role.strip() for role in roles)


def is_marker(marker: Any) -> bool:
    if isinstance(marker, str):
        return bool(marker)
    return (
        isinstance(marker, (list, tuple))
        and bool(marker)
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in marker)
    )


def load_boundaries_file(path: Path, value: Any, name: str) -> Any:
    if not path.is_file():
        raise fail(name, value, _BOUNDARIES_TEXT + " (no such file)")
    text = path.read_text()
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise fail(name, value, _BOUNDARIES_TEXT + " (the file is not valid JSON)") from None
    try:
        import yaml
    except ImportError:
        raise fail(name, value, "a .json file, or install pyyaml to read .yaml files") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        raise fail(name, value, _BOUNDARIES_TEXT + " (the file is not valid YAML)") from None


def parse_boundaries(value: Any, name: str) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    data = value
    if isinstance(value, os.PathLike):
        data = load_boundaries_file(Path(value), value, name)
    elif isinstance(value, str):
        text = value.strip()
        if text.lower() == "none":
            return None
        if text.startswith(("[", "{")):
            try:
                data = json.loads(text)
            except json.JSONDecodeError:
                raise fail(name, value, _BOUNDARIES_TEXT) from None
        elif text.endswith((".json", ".yaml", ".yml")):
            data = load_boundaries_file(Path(text).expanduser(), value, name)
        else:
            raise fail(name, value, _BOUNDARIES_TEXT)
    if not isinstance(data, (list, tuple)) or not data:
        raise fail(name, value, _BOUNDARIES_TEXT)
    boundaries = []
    for index, item in enumerate(data):
        where = f"{name}[{index}]"
        if not isinstance(item, Mapping) or set(item) != set(BOUNDARY_KEYS):
            raise fail(where, item, _BOUNDARIES_TEXT)
        role = item["role"]
        if not (isinstance(role, str) and role.strip()):
            raise fail(f"{where}.role", role, "a non-empty role name such as assistant")
        if not is_marker(item["start"]):
            raise fail(f"{where}.start", item["start"], "a non-empty string or list of token ids")
        if item["end"] is not None and not is_marker(item["end"]):
            raise fail(
                f"{where}.end",
                item["end"],
                "a non-empty string, a list of token ids, or null (the turn runs to the next"
                " start)",
            )
        for key in ("include_start", "include_end"):
            if not isinstance(item[key], bool):
                raise fail(f"{where}.{key}", item[key], "true or false")
        boundaries.append(
            {
                "role": role.strip(),
                "start": item["start"] if isinstance(item["start"], str) else list(item["start"]),
                "end": item["end"]
                if item["end"] is None or isinstance(item["end"], str)
                else list(item["end"]),
                "include_start": item["include_start"],
                "include_end": item["include_end"],
            }
        )
    return boundaries


def parse_path(value: Any, name: str) -> str:
    if isinstance(value, (str, os.PathLike)) and str(value).strip():
        return os.path.expanduser(str(value).strip())
    raise fail(name, value, "a directory path")


def check_roles(roles: tuple[str, ...], boundaries: list[dict[str, Any]] | None, name: str) -> None:
    custom = [b["role"] for b in boundaries or () if b["role"] not in KNOWN_ROLES]
    valid = [*KNOWN_ROLES, *dict.fromkeys(custom)]
    unknown = [role for role in roles if role not in valid]
    if unknown:
        raise fail(name, ",".join(roles), ", ".join(valid) + " (or a role of role_boundaries)")
