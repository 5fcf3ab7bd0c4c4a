"""The patch registry: wraps library attributes with wrapt, puts the originals back by identity.

One more kind of patch, for a plain function that scripts bind by name before ``enable()``
(``from peft import prepare_model_for_kbit_training``): replacing the attribute of its module
would miss those bindings, so ``redirect`` points the function object's own code at the wrapper
(every binding is that object) and puts the code back on restore.
"""

from __future__ import annotations

import inspect
import types
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


@dataclass(frozen=True)
class RedirectRecord:
    """One redirected function: its own code, put back on restore, and the name of the
    dispatcher its trampoline calls, set in the function's globals while redirected."""

    function: types.FunctionType
    code: types.CodeType
    dispatcher: str
    group: str


_redirects: dict[int, RedirectRecord] = {}


def redirect(
    function: types.FunctionType,
    wrapper: Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any],
    group: str,
) -> None:
    """Make every call of ``function``, through whatever name holds it, call ``wrapper(original,
    None, args, kwargs)``, where ``original`` is a copy of the function as it was. Redirecting a
    function twice is a no-op."""
    if id(function) in _redirects:
        return
    if function.__code__.co_freevars:
        raise TypeError(f"cannot redirect {function.__qualname__}: it is a closure")
    original = types.FunctionType(
        function.__code__,
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    original.__kwdefaults__ = function.__kwdefaults__
    original.__qualname__ = function.__qualname__
    dispatcher = f"__autooffload_redirect_{function.__name__}_{id(function):x}"

    def dispatch(*args: Any, **kwargs: Any) -> Any:
        return wrapper(original, None, args, kwargs)

    namespace: dict[str, Any] = {}
    exec(f"def trampoline(*args, **kwargs):\n    return {dispatcher}(*args, **kwargs)\n", namespace)
    code = namespace["trampoline"].__code__.replace(
        co_name=function.__code__.co_name,
        co_filename=function.__code__.co_filename,
        co_firstlineno=function.__code__.co_firstlineno,
    )
    function.__globals__[dispatcher] = dispatch
    _redirects[id(function)] = RedirectRecord(function, function.__code__, dispatcher, group)
    function.__code__ = code
    logger.debug("redirected %s (%s)", function.__qualname__, group)


def _unredirect(record: RedirectRecord) -> None:
    record.function.__code__ = record.code
    record.function.__globals__.pop(record.dispatcher, None)
    logger.debug("restored %s (%s)", record.function.__qualname__, record.group)


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
    """Put back every original wrapped or redirected under ``group``, newest first."""
    for key, record in reversed(list(_records.items())):
        if record.group == group:
            _restore(record)
            del _records[key]
    for key, redirected in reversed(list(_redirects.items())):
        if redirected.group == group:
            _unredirect(redirected)
            del _redirects[key]


def restore_all() -> None:
    """Put back every original the registry holds, newest first."""
    for key, record in reversed(list(_records.items())):
        _restore(record)
        del _records[key]
    for key, redirected in reversed(list(_redirects.items())):
        _unredirect(redirected)
        del _redirects[key]


def records() -> list[PatchRecord]:
    """The attributes wrapped now, oldest first (for tests and debugging)."""
    return list(_records.values())


def redirects() -> list[RedirectRecord]:
    """The functions redirected now, oldest first (for tests and debugging)."""
    return list(_redirects.values())


def _name_of(owner: Any) -> str:
    return getattr(owner, "__qualname__", None) or getattr(owner, "__name__", type(owner).__name__)
