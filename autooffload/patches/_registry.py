"""The patch registry: wraps library attributes with wrapt, puts the originals back by identity."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import wrapt

from autooffload.log import logger

_MISSING = object()


@dataclass(frozen=True)
class PatchRecord:
    """One wrapped attribute: where it lives, what was there before, and who wrapped it.

    ``original`` is the object found in ``owner.__dict__`` (for a class: the raw descriptor, so a
    staticmethod or classmethod is restored as itself), or the inherited object when the attribute
    was not defined on ``owner`` itself (``own`` is then False and restore deletes the wrapper).
    """

    owner: Any
    attr: str
    original: Any
    wrapper: wrapt.FunctionWrapper
    group: str
    own: bool


_records: dict[tuple[int, str], PatchRecord] = {}


def _lookup(owner: Any, attr: str) -> tuple[Any, bool]:
    """The object behind ``owner.attr`` as stored (descriptor for classes) and whether it is own."""
    if inspect.isclass(owner):
        for klass in owner.__mro__:
            if attr in klass.__dict__:
                return klass.__dict__[attr], klass is owner
        raise AttributeError(f"{owner.__qualname__} has no attribute {attr!r} to patch")
    own = vars(owner).get(attr, _MISSING) if hasattr(owner, "__dict__") else _MISSING
    if own is not _MISSING:
        return own, True
    return getattr(owner, attr), False


def wrap(
    owner: Any,
    attr: str,
    wrapper: Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any],
    group: str,
    factory: type[wrapt.FunctionWrapper] = wrapt.FunctionWrapper,
) -> wrapt.FunctionWrapper:
    """Replace ``owner.attr`` by a ``wrapt.FunctionWrapper`` calling ``wrapper(wrapped, instance,
    args, kwargs)``; remember the original under ``group``. Wrapping an attribute twice is a no-op
    that returns the existing wrapper. ``factory`` is a ``FunctionWrapper`` subclass for wrappers
    that need more of the descriptor protocol (e.g. a property's setter)."""
    key = (id(owner), attr)
    record = _records.get(key)
    if record is not None:
        return record.wrapper
    original, own = _lookup(owner, attr)
    function_wrapper = factory(original, wrapper)
    setattr(owner, attr, function_wrapper)
    _records[key] = PatchRecord(owner, attr, original, function_wrapper, group, own)
    logger.debug("patched %s.%s (%s)", _name_of(owner), attr, group)
    return function_wrapper


def _restore(record: PatchRecord) -> None:
    if record.own:
        setattr(record.owner, record.attr, record.original)
    else:
        delattr(record.owner, record.attr)
    logger.debug("restored %s.%s (%s)", _name_of(record.owner), record.attr, record.group)


def restore_group(group: str) -> None:
    """Put back every original wrapped under ``group``, newest first."""
    for key, record in reversed(list(_records.items())):
        if record.group == group:
            _restore(record)
            del _records[key]


def restore_all() -> None:
    """Put back every original the registry holds, newest first."""
    for key, record in reversed(list(_records.items())):
        _restore(record)
        del _records[key]


def records() -> list[PatchRecord]:
    """The attributes wrapped now, oldest first (for tests and debugging)."""
    return list(_records.values())


def _name_of(owner: Any) -> str:
    return getattr(owner, "__qualname__", None) or getattr(owner, "__name__", type(owner).__name__)
