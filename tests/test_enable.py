"""Tests of autooffload/__init__.py: enable/disable, identity restore, import-order independence."""

from __future__ import annotations

import inspect
import json
import logging
import os
import subprocess
import sys
import textwrap
import types
import uuid
from pathlib import Path

import pytest

import autooffload
from autooffload import log, patches
from autooffload import settings as settings_module
from autooffload.errors import SettingsError
from autooffload.patches import _registry

REPO = Path(__file__).resolve().parents[1]


def make_patch_module(name: str, target: str, owner_attr: tuple[str, str]) -> types.ModuleType:
    """A patch module following the contract: wraps ``<target>.<attr>`` to tag its results."""
    module_name = f"autooffload.patches.{name}"
    module = types.ModuleType(module_name)
    module.TARGETS = (target,)
    module.installs = []
    module.uninstalls = 0

    def install(settings, imported_target):
        module.installs.append((settings, imported_target))
        owner = sys.modules[owner_attr[0]]
        _registry.wrap(
            owner, owner_attr[1], lambda w, i, a, k: ("patched", w(*a, **k)), module_name
        )

    def uninstall():
        module.uninstalls += 1
        _registry.restore_group(module_name)

    module.install, module.uninstall = install, uninstall
    return module


@pytest.fixture
def fake_json_patch(monkeypatch):
    """Make ``PATCH_MODULES`` one fake patch module that wraps ``json.dumps``."""
    module = make_patch_module("_fake_json", "json", ("json", "dumps"))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(patches, "PATCH_MODULES", ("_fake_json",))
    return module


def stored(owner, attr):
    """What ``owner.attr`` is bound to where it is defined (the raw descriptor for classes)."""
    if inspect.isclass(owner):
        return next(k.__dict__[attr] for k in owner.__mro__ if attr in k.__dict__)
    return getattr(owner, attr)


def test_plain_import_enables_nothing():
    code = "import sys, autooffload; print(autooffload.settings.current(), 'torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    )
    assert out.stdout.split() == ["None", "False"]


def test_enable_installs_and_disable_restores_by_identity(fake_json_patch):
    original = json.dumps
    settings = autooffload.enable(budget="2GiB")
    assert settings.budget == 2 << 30
    assert settings_module.current() is settings
    assert json.dumps({}) == ("patched", "{}")
    assert fake_json_patch.installs == [(settings, "json")]
    autooffload.disable()
    assert json.dumps is original
    assert json.dumps({}) == "{}"
    assert settings_module.current() is None
    assert fake_json_patch.uninstalls == 1


def test_enable_twice_is_idempotent(fake_json_patch):
    first = autooffload.enable()
    wrapper = json.dumps
    second = autooffload.enable()
    assert second is first
    assert json.dumps is wrapper
    assert json.dumps([1]) == ("patched", "[1]")  # wrapped once, not twice
    assert len(fake_json_patch.installs) == 1
    assert len(_registry.records()) == 1


def test_enable_with_new_settings_reinstalls_with_them(fake_json_patch):
    original = json.dumps
    autooffload.enable(budget="1GiB")
    new = autooffload.enable(budget="3GiB")
    assert settings_module.current() is new
    assert [s.budget for s, _ in fake_json_patch.installs] == [1 << 30, 3 << 30]
    assert json.dumps(1) == ("patched", "1")
    autooffload.disable()
    assert json.dumps is original


def test_autooffload_0_validates_then_does_nothing(fake_json_patch, monkeypatch):
    original = json.dumps
    monkeypatch.setenv("AUTOOFFLOAD", "0")
    settings = autooffload.enable()
    assert settings.enabled is False
    assert json.dumps is original and fake_json_patch.installs == []
    assert settings_module.current() is None
    monkeypatch.setenv("AUTOOFFLOAD_BUDGET", "lots")
    with pytest.raises(SettingsError, match="AUTOOFFLOAD_BUDGET"):
        autooffload.enable()


def test_enabled_false_turns_an_enabled_process_off(fake_json_patch):
    original = json.dumps
    autooffload.enable()
    autooffload.enable(enabled=False)
    assert json.dumps is original
    assert settings_module.current() is None


def test_bad_settings_fail_before_anything_is_installed(fake_json_patch, monkeypatch):
    original = json.dumps
    monkeypatch.setenv("AUTOOFFLOAD_BUDJET", "12GiB")
    with pytest.raises(SettingsError, match="did you mean AUTOOFFLOAD_BUDGET"):
        autooffload.enable()
    assert json.dumps is original and fake_json_patch.installs == []
    assert settings_module.current() is None


def test_enable_configures_the_package_logger(fake_json_patch):
    autooffload.enable(log="debug")
    assert logging.getLogger("autooffload").level == logging.DEBUG
    autooffload.enable(log="error")
    assert logging.getLogger("autooffload").level == logging.ERROR


def test_disable_forgets_emitted_warnings(fake_json_patch):
    autooffload.enable(log="error")
    with pytest.warns(UserWarning, match="once"):
        log.warn_once("test-key", "once")
    autooffload.disable()
    with pytest.warns(UserWarning, match="once"):
        log.warn_once("test-key", "once")


def fake_runtime(monkeypatch) -> types.ModuleType:
    runtime = types.ModuleType("autooffload.runtime")
    runtime.calls = []
    runtime.detach_all = lambda: runtime.calls.append("detach_all")
    runtime.last_plan = lambda: "the plan"

    def attach(model, optimizer=None, settings=None):
        runtime.calls.append(("attach", model, optimizer, settings))
        return "runtime"

    runtime.attach = attach
    monkeypatch.setitem(sys.modules, "autooffload.runtime", runtime)
    return runtime


def test_disable_detaches_every_runtime_before_restoring(fake_json_patch, monkeypatch):
    runtime = fake_runtime(monkeypatch)
    autooffload.enable()
    autooffload.disable()
    assert runtime.calls == ["detach_all"]


def test_attach_and_last_plan_delegate_to_the_runtime(monkeypatch):
    runtime = fake_runtime(monkeypatch)
    model, optimizer = object(), object()
    assert autooffload.attach(model, optimizer, budget="4GiB", n_persist=2) == "runtime"
    (_, got_model, got_optimizer, got_settings) = runtime.calls[0]
    assert got_model is model and got_optimizer is optimizer
    assert (got_settings.budget, got_settings.n_persist) == (4 << 30, 2)
    assert autooffload.last_plan() == "the plan"
    with pytest.raises(SettingsError, match="n_persist"):
        autooffload.attach(model, n_persist=-1)
    assert len(runtime.calls) == 1


def test_last_plan_is_none_when_no_runtime_was_loaded(monkeypatch):
    monkeypatch.delitem(sys.modules, "autooffload.runtime", raising=False)
    assert autooffload.last_plan() is None


def test_target_imported_after_enable_is_patched_by_the_hook(monkeypatch, tmp_path):
    target = f"fake_lib_{uuid.uuid4().hex}"
    (tmp_path / f"{target}.py").write_text("def run(x):\n    return x * 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = make_patch_module("_fake_late", target, (target, "run"))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(patches, "PATCH_MODULES", ("_fake_late",))

    autooffload.enable()
    assert module.installs == []
    lib = __import__(target)
    assert lib.run(2) == ("patched", 4)
    assert [t for _, t in module.installs] == [target]
    autooffload.disable()
    assert lib.run(2) == 4


def test_hook_does_nothing_once_disabled(monkeypatch, tmp_path):
    target = f"fake_lib_{uuid.uuid4().hex}"
    (tmp_path / f"{target}.py").write_text("def run(x):\n    return x * 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = make_patch_module("_fake_stale", target, (target, "run"))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(patches, "PATCH_MODULES", ("_fake_stale",))

    autooffload.enable()
    autooffload.disable()
    lib = __import__(target)
    assert lib.run(2) == 4 and module.installs == []
    autooffload.enable()
    assert lib.run(2) == ("patched", 4)
    assert len(module.installs) == 1


def test_a_patch_module_with_a_broken_import_is_not_hidden(monkeypatch, tmp_path):
    (tmp_path / "_broken_import.py").write_text("import a_module_that_does_not_exist_anywhere\n")
    monkeypatch.setattr(patches, "__path__", [*patches.__path__, str(tmp_path)])
    monkeypatch.setattr(patches, "PATCH_MODULES", ("_broken_import",))
    with pytest.raises(ModuleNotFoundError, match="a_module_that_does_not_exist_anywhere"):
        autooffload.enable()


def test_every_attribute_touched_by_the_real_patches_is_restored(fake_json_patch, monkeypatch):
    import peft  # noqa: F401 - peft_lora's target (its wraps and its redirect)
    import torch  # noqa: F401 - imported first so the torch patches install at once
    import transformers  # noqa: F401
    import transformers.generation.utils  # noqa: F401 - sharded_generate's target

    real = ("torch_module", "torch_optim", "peft_lora", "bnb", "hf_collators", "sharded_generate")
    monkeypatch.setattr(patches, "PATCH_MODULES", (*real, "_fake_json"))
    autooffload.enable()
    touched = [(r.owner, r.attr, r.original, r.own) for r in _registry.records()]
    assert touched, "no patch was installed"
    redirected = [(r.function, r.code) for r in _registry.redirects()]
    assert redirected, "peft_lora's redirect of prepare_model_for_kbit_training not installed"
    assert any(attr == "generate" for _, attr, _, _ in touched), "sharded_generate not installed"
    autooffload.disable()
    for owner, attr, original, own in touched:
        assert stored(owner, attr) is original, f"{owner!r}.{attr} not restored"
        if inspect.isclass(owner) and not own:
            assert attr not in owner.__dict__
    for function, code in redirected:
        assert function.__code__ is code, f"{function.__qualname__} not restored"
    assert _registry.records() == [] and _registry.redirects() == []


# transformers' processing_utils re-executes transformers/__init__.py, replacing the top-level
# module object in sys.modules, so patches wrap attributes of submodules and classes, as here.
IMPORT_ORDER_SCRIPT = textwrap.dedent(
    """
    import importlib, inspect, sys, types
    import autooffload
    from autooffload import patches
    from autooffload.patches import _registry

    target, owner_path, attr, order = sys.argv[1:5]
    module_name, _, class_name = owner_path.partition(":")
    name = "autooffload.patches._fake_target"
    fake = types.ModuleType(name)
    fake.TARGETS = (target,)

    def owner():
        module = importlib.import_module(module_name)
        return getattr(module, class_name) if class_name else module

    def install(settings, imported):
        _registry.wrap(owner(), attr, lambda w, i, a, k: "patched", name)

    def call():
        return getattr(owner()() if class_name else owner(), attr)()

    fake.install = install
    fake.uninstall = lambda: _registry.restore_group(name)
    sys.modules[name] = fake
    patches.PATCH_MODULES = ("_fake_target",)

    if order == "before":
        importlib.import_module(target)
    autooffload.enable()
    if order == "after":
        assert target not in sys.modules
        importlib.import_module(target)
    (record,) = _registry.records()
    assert call() == "patched"
    autooffload.disable()
    stored = vars(owner()).get(attr) if class_name else getattr(owner(), attr)
    assert stored is record.original
    assert call() != "patched"
    print("restored")
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize(
    ("target", "owner", "attr"),
    [
        ("fake_lib", "fake_lib", "run"),
        ("transformers", "transformers.configuration_utils:PretrainedConfig", "to_json_string"),
    ],
)
def test_import_order_independence(tmp_path, order, target, owner, attr):
    (tmp_path / "fake_lib.py").write_text("def run():\n    return 'original'\n")
    script = tmp_path / "check.py"
    script.write_text(IMPORT_ORDER_SCRIPT)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}"}
    result = subprocess.run(
        [sys.executable, str(script), target, owner, attr, order],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "restored"
