"""Tests of autooffload/patches/_registry.py: wrapping, no double wrap, restore by identity."""

from __future__ import annotations

import types

import pytest

from autooffload.patches import _registry


def tagging(tag):
    """A wrapt wrapper returning ``(tag, original result)`` so a test sees it ran."""

    def wrapper(wrapped, instance, args, kwargs):
        return (tag, wrapped(*args, **kwargs))

    return wrapper


class Base:
    def greet(self, name):
        return f"hi {name}"

    @staticmethod
    def static(x):
        return x + 1

    @classmethod
    def make(cls):
        return cls


class Child(Base):
    pass


@pytest.fixture(autouse=True)
def _empty_registry():
    yield
    _registry.restore_all()


def test_wraps_a_module_function_and_restores_the_identical_object():
    module = types.ModuleType("fake_lib")
    module.dumps = lambda x: f"<{x}>"
    original = module.dumps
    _registry.wrap(module, "dumps", tagging("w"), "g")
    assert module.dumps(1) == ("w", "<1>")
    assert module.dumps is not original
    _registry.restore_group("g")
    assert module.dumps is original
    assert _registry.records() == []


def test_method_wrapper_sees_the_instance_and_restore_is_by_identity_in_class_dict():
    original = Base.__dict__["greet"]
    seen = []

    def wrapper(wrapped, instance, args, kwargs):
        seen.append(instance)
        return wrapped(*args, **kwargs).upper()

    try:
        _registry.wrap(Base, "greet", wrapper, "g")
        obj = Base()
        assert obj.greet("ann") == "HI ANN"
        assert seen == [obj]
    finally:
        _registry.restore_group("g")
    assert Base.__dict__["greet"] is original


def test_static_and_class_methods_restore_as_the_same_descriptor_objects():
    static, klass = Base.__dict__["static"], Base.__dict__["make"]
    _registry.wrap(Base, "static", tagging("s"), "g")
    _registry.wrap(Base, "make", tagging("c"), "g")
    assert Base.static(1) == ("s", 2)
    assert Base().static(1) == ("s", 2)
    assert Child.make() == ("c", Child)
    _registry.restore_all()
    assert Base.__dict__["static"] is static
    assert Base.__dict__["make"] is klass
    assert Base.static(1) == 2 and Child.make() is Child


def test_inherited_attribute_is_wrapped_on_the_subclass_and_removed_on_restore():
    _registry.wrap(Child, "greet", tagging("child"), "g")
    assert Child().greet("bo") == ("child", "hi bo")
    assert Base().greet("bo") == "hi bo"
    _registry.restore_all()
    assert "greet" not in Child.__dict__
    assert Child.greet is Base.__dict__["greet"]


def test_second_wrap_of_the_same_attribute_is_a_no_op():
    module = types.ModuleType("fake_lib")
    module.f = lambda: 1
    original = module.f
    first = _registry.wrap(module, "f", tagging("a"), "g")
    second = _registry.wrap(module, "f", tagging("b"), "g")
    assert second is first
    assert module.f() == ("a", 1)
    assert len(_registry.records()) == 1
    _registry.restore_all()
    assert module.f is original


def test_restore_group_leaves_other_groups_wrapped():
    module = types.ModuleType("fake_lib")
    module.f, module.g = (lambda: 1), (lambda: 2)
    f, g = module.f, module.g
    _registry.wrap(module, "f", tagging("a"), "group_a")
    _registry.wrap(module, "g", tagging("b"), "group_b")
    _registry.restore_group("group_a")
    assert module.f is f
    assert module.g() == ("b", 2)
    assert [record.group for record in _registry.records()] == ["group_b"]
    _registry.restore_all()
    assert module.g is g


def test_records_describe_what_was_wrapped():
    module = types.ModuleType("fake_lib")
    module.f = lambda: 1
    original = module.f
    wrapper = _registry.wrap(module, "f", tagging("a"), "grp")
    (record,) = _registry.records()
    assert (record.owner, record.attr, record.original) == (module, "f", original)
    assert (record.wrapper, record.group, record.own) == (wrapper, "grp", True)


def test_missing_class_attribute_is_an_error():
    with pytest.raises(AttributeError, match="nope"):
        _registry.wrap(Base, "nope", tagging("x"), "g")
    assert _registry.records() == []


def _greet(name: str, punctuation: str = "!", *, loud: bool = False) -> str:
    text = f"hello {name}{punctuation}"
    return text.upper() if loud else text


def test_redirect_reaches_names_bound_before_it_and_restores_the_code():
    bound = _greet  # as ``from module import function`` before enable()
    code = _greet.__code__
    calls = []

    def wrapper(wrapped, instance, args, kwargs):
        calls.append((args, kwargs))
        return "<" + wrapped(*args, **kwargs) + ">"

    _registry.redirect(_greet, wrapper, "group_r")
    _registry.redirect(_greet, wrapper, "group_r")  # twice: a no-op
    assert bound("ada", loud=True) == "<HELLO ADA!>"  # defaults and keyword-only kept
    assert calls == [(("ada",), {"loud": True})]
    assert [r.function for r in _registry.redirects()] == [_greet]
    _registry.restore_group("group_r")
    assert bound.__code__ is code and bound("ada") == "hello ada!"
    assert _registry.redirects() == []
    assert not [name for name in globals() if name.startswith("__autooffload")]


def test_redirect_refuses_a_closure():
    secret = "x"

    def closure() -> str:
        return secret

    with pytest.raises(TypeError, match="closure"):
        _registry.redirect(closure, lambda *a: None, "group_r")
