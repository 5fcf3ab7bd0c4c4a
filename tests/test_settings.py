"""Tests of autooffload/settings.py: parsing of every knob, and every error message."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from autooffload import settings as settings_module
from autooffload.errors import SettingsError
from autooffload.settings import Settings

GiB = 1 << 30
BOUNDARY = {
    "role": "bot",
    "start": "<bot>",
    "end": [7, 8],
    "include_start": False,
    "include_end": True,
}


def expect_error(match_all: list[str], **kwargs) -> SettingsError:
    """Build Settings from env + kwargs, expect a SettingsError containing every string."""
    with pytest.raises(SettingsError) as info:
        Settings.from_env(**kwargs)
    message = str(info.value)
    for needle in match_all:
        assert needle in message, f"{needle!r} not in {message!r}"
    return info.value


def test_defaults_match_the_contract():
    s = Settings.from_env()
    assert s == Settings()
    assert (s.enabled, s.offload, s.mask, s.force_attach, s.master_weights) == (
        True,
        True,
        True,
        False,
        False,
    )
    assert s.budget is None and s.device is None and s.role_boundaries is None
    assert s.activation_mode == "auto" and s.train_on_eos == "turn" and s.log == "info"
    assert s.attach_threshold == GiB
    assert s.roles_to_train == ("assistant",)
    assert s.cache_dir == str(Path("~/.cache/autooffload").expanduser())


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("12GiB", 12 * GiB),
        ("12gib", 12 * GiB),
        ("12 GiB", 12 * GiB),
        ("12G", 12 * GiB),
        ("12GB", 12 * 10**9),
        ("12000MB", 12 * 10**9),
        ("1.5GiB", 3 * GiB // 2),
        ("1073741824", GiB),
        ("0.5", 0.5),
        ("1.0", 1.0),
        ("1", 1.0),
        ("1048576", 1 << 20),
        ("900KB", 900_000),
        ("auto", None),
    ],
)
def test_budget_env_sizes(monkeypatch, text, expected):
    monkeypatch.setenv("AUTOOFFLOAD_BUDGET", text)
    value = Settings.from_env().budget
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(
    "bad", ["lots", "1.5", "0.0", "-1GiB", "12XB", "0", "GiB", "12 GiB free", "8", "1048575", "1B"]
)
def test_bad_budget_env_names_var_value_and_valid_values(monkeypatch, bad):
    monkeypatch.setenv("AUTOOFFLOAD_BUDGET", bad)
    expect_error(["AUTOOFFLOAD_BUDGET", repr(bad), "12GiB", "fraction", "0.5"])


@pytest.mark.parametrize("bad", ["lots", 2.0, -5, True, [1]])
def test_bad_budget_kwarg_names_kwarg(bad):
    expect_error(["budget=", repr(bad), "12GiB"], budget=bad)


def test_a_bare_number_is_a_fraction_up_to_one_and_bytes_only_from_one_mebibyte(monkeypatch):
    assert Settings.from_env(budget=1).budget == 1.0  # the whole device, as "1.0"
    assert Settings.from_env(host_budget="1").host_budget == 1.0
    monkeypatch.setenv("AUTOOFFLOAD_BUDGET", "24")
    expect_error(["AUTOOFFLOAD_BUDGET", "'24'", "bare number", "unit"])


def test_size_kwargs_accept_ints_floats_and_strings():
    assert Settings(budget=GiB).budget == GiB
    assert Settings(budget=0.25).budget == 0.25
    assert Settings(host_budget="64GiB").host_budget == 64 * GiB
    assert Settings(chunk_size="64MiB").chunk_size == 64 << 20
    assert Settings(attach_threshold=0).attach_threshold == 0


def test_chunk_size_is_bytes_only(monkeypatch):
    monkeypatch.setenv("AUTOOFFLOAD_CHUNK_SIZE", "0.5")
    error = expect_error(["AUTOOFFLOAD_CHUNK_SIZE", "'0.5'", "12GiB"])
    assert "fraction" not in str(error)


def test_attach_threshold_has_no_auto(monkeypatch):
    monkeypatch.setenv("AUTOOFFLOAD_ATTACH_THRESHOLD", "auto")
    error = expect_error(["AUTOOFFLOAD_ATTACH_THRESHOLD", "'auto'", "12GiB"])
    assert "or auto" not in str(error)


@pytest.mark.parametrize(
    ("text", "expected"),
    [(t, True) for t in ("1", "true", "TRUE", "yes", "on", " On ")]
    + [(f, False) for f in ("0", "false", "no", "off", "OFF")],
)
def test_bool_env_values(monkeypatch, text, expected):
    monkeypatch.setenv("AUTOOFFLOAD_MASK", text)
    assert Settings.from_env().mask is expected


def test_chunk_pool_is_compute_or_copy(monkeypatch):
    assert Settings.from_env().chunk_pool == "compute"
    monkeypatch.setenv("AUTOOFFLOAD_CHUNK_POOL", "copy")
    assert Settings.from_env().chunk_pool == "copy"
    monkeypatch.setenv("AUTOOFFLOAD_CHUNK_POOL", "h2d")
    expect_error(["AUTOOFFLOAD_CHUNK_POOL", "'h2d'", "compute", "copy"])


@pytest.mark.parametrize(
    ("text", "expected"), [("auto", None), ("AUTO", None), ("1", True), ("off", False)]
)
def test_expandable_segments_is_auto_or_a_bool(monkeypatch, text, expected):
    monkeypatch.setenv("AUTOOFFLOAD_EXPANDABLE_SEGMENTS", text)
    assert Settings.from_env().expandable_segments is expected
    monkeypatch.setenv("AUTOOFFLOAD_EXPANDABLE_SEGMENTS", "sometimes")
    expect_error(["AUTOOFFLOAD_EXPANDABLE_SEGMENTS", "'sometimes'", "auto", "true/false"])


def test_bad_bool_names_var_value_and_valid_values(monkeypatch):
    monkeypatch.setenv("AUTOOFFLOAD_FORCE_ATTACH", "maybe")
    expect_error(["AUTOOFFLOAD_FORCE_ATTACH", "'maybe'", "1/0", "true/false", "yes/no", "on/off"])
    expect_error(["offload=", "'maybe'", "true/false"], offload="maybe", force_attach=False)


@pytest.mark.parametrize("field", ["n_persist", "n_buffer", "n_swap", "n_checkpoint"])
def test_counts(monkeypatch, field):
    env = f"AUTOOFFLOAD_{field.upper()}"
    monkeypatch.setenv(env, "3")
    assert getattr(Settings.from_env(), field) == 3
    monkeypatch.setenv(env, "auto")
    assert getattr(Settings.from_env(), field) is None
    monkeypatch.setenv(env, "-1")
    expect_error([env, "'-1'", "integer >= 0"])
    monkeypatch.setenv(env, "2.5")
    expect_error([env, "'2.5'", "integer >= 0"])
    monkeypatch.delenv(env)
    expect_error([f"{field}=-1", "integer >= 0"], **{field: -1})
    assert getattr(Settings.from_env(**{field: 0}), field) == 0


@pytest.mark.parametrize(
    ("field", "good", "bad", "choices"),
    [
        ("activation_mode", "SWAP", "fast", ["auto", "keep", "checkpoint", "swap", "off"]),
        ("train_on_eos", "last", "first", ["turn", "last", "all", "none"]),
        ("log", "DEBUG", "loud", ["debug", "info", "warning", "error"]),
        ("device", "cpu", "tpu", ["cuda", "cpu", "auto"]),
    ],
)
def test_enums(monkeypatch, field, good, bad, choices):
    env = f"AUTOOFFLOAD_{field.upper()}"
    monkeypatch.setenv(env, good)
    assert getattr(Settings.from_env(), field) == good.lower()
    monkeypatch.setenv(env, bad)
    expect_error([env, repr(bad), *choices])


def test_device_auto_means_none(monkeypatch):
    monkeypatch.setenv("AUTOOFFLOAD_DEVICE", "auto")
    assert Settings.from_env().device is None


@pytest.mark.parametrize(
    "text", ["assistant,user", " assistant , user ", '["assistant", "user"]', "assistant,,user"]
)
def test_roles_comma_or_json(monkeypatch, text):
    monkeypatch.setenv("AUTOOFFLOAD_ROLES_TO_TRAIN", text)
    assert Settings.from_env().roles_to_train == ("assistant", "user")


def test_unknown_role_names_var_value_and_known_roles(monkeypatch):
    monkeypatch.setenv("AUTOOFFLOAD_ROLES_TO_TRAIN", "assistant,wizard")
    expect_error(["AUTOOFFLOAD_ROLES_TO_TRAIN", "assistant,wizard", "assistant", "user", "system"])
    monkeypatch.delenv("AUTOOFFLOAD_ROLES_TO_TRAIN")
    expect_error(["roles_to_train=", "wizard", "assistant"], roles_to_train=["wizard"])


@pytest.mark.parametrize("bad", ["", " , ", "[1, 2]", "[not json"])
def test_malformed_roles(bad):
    expect_error(["roles_to_train=", "role names"], roles_to_train=bad)


@pytest.mark.parametrize("empty", [[], (), "[]"])
def test_no_roles_to_train_masks_every_role(monkeypatch, empty):
    """docs/masking.md: ``[]`` masks every role (it was refused as malformed)."""
    assert Settings.from_env(roles_to_train=empty).roles_to_train == ()
    monkeypatch.setenv("AUTOOFFLOAD_ROLES_TO_TRAIN", "[]")
    assert Settings.from_env().roles_to_train == ()


def test_role_boundary_end_may_be_null(monkeypatch):
    """docs/masking.md: ``end`` null means the turn runs to the next start (it was refused)."""
    open_ended = {**BOUNDARY, "end": None}
    assert Settings.from_env(role_boundaries=[open_ended]).role_boundaries == [open_ended]
    monkeypatch.setenv("AUTOOFFLOAD_ROLE_BOUNDARIES", json.dumps([open_ended]))
    assert Settings.from_env().role_boundaries == [open_ended]


def test_custom_role_allowed_when_boundaries_define_it():
    s = Settings.from_env(roles_to_train="bot", role_boundaries=[BOUNDARY])
    assert s.roles_to_train == ("bot",)
    assert s.role_boundaries == [BOUNDARY]


def test_role_boundaries_json_env(monkeypatch):
    monkeypatch.setenv("AUTOOFFLOAD_ROLE_BOUNDARIES", json.dumps([BOUNDARY]))
    assert Settings.from_env().role_boundaries == [BOUNDARY]


def test_role_boundaries_json_and_yaml_files(monkeypatch, tmp_path):
    json_path = tmp_path / "roles.json"
    json_path.write_text(json.dumps([BOUNDARY]))
    yaml_path = tmp_path / "roles.yaml"
    yaml_path.write_text(
        "- role: bot\n  start: <bot>\n  end: [7, 8]\n  include_start: false\n  include_end: true\n"
    )
    for path in (json_path, yaml_path):
        monkeypatch.setenv("AUTOOFFLOAD_ROLE_BOUNDARIES", str(path))
        assert Settings.from_env().role_boundaries == [BOUNDARY]
    assert Settings(role_boundaries=yaml_path).role_boundaries == [BOUNDARY]


@pytest.mark.parametrize(
    ("bad", "where", "valid"),
    [
        ("not json", "AUTOOFFLOAD_ROLE_BOUNDARIES", "JSON list"),
        ("[{", "AUTOOFFLOAD_ROLE_BOUNDARIES", "JSON list"),
        ("[]", "AUTOOFFLOAD_ROLE_BOUNDARIES", "JSON list"),
        ('{"role": "bot"}', "AUTOOFFLOAD_ROLE_BOUNDARIES", "JSON list"),
        ("/nonexistent/roles.yaml", "AUTOOFFLOAD_ROLE_BOUNDARIES", "no such file"),
        (json.dumps([{**BOUNDARY, "stop": 1}]), "AUTOOFFLOAD_ROLE_BOUNDARIES[0]", "include_end"),
        (json.dumps([{"role": "bot"}]), "AUTOOFFLOAD_ROLE_BOUNDARIES[0]", "include_start"),
        (json.dumps([{**BOUNDARY, "role": ""}]), "[0].role", "role name"),
        (json.dumps([{**BOUNDARY, "start": ""}]), "[0].start", "list of token ids"),
        (json.dumps([{**BOUNDARY, "end": [1, -2]}]), "[0].end", "list of token ids"),
        (json.dumps([{**BOUNDARY, "end": []}]), "[0].end", "list of token ids"),
        (json.dumps([{**BOUNDARY, "include_end": 1}]), "[0].include_end", "true or false"),
    ],
)
def test_bad_role_boundaries(monkeypatch, bad, where, valid):
    monkeypatch.setenv("AUTOOFFLOAD_ROLE_BOUNDARIES", bad)
    error = expect_error([where, valid])
    assert "AUTOOFFLOAD_ROLE_BOUNDARIES" in str(error)


def test_invalid_yaml_file(monkeypatch, tmp_path):
    path = tmp_path / "roles.yml"
    path.write_text("- role: [unclosed\n")
    monkeypatch.setenv("AUTOOFFLOAD_ROLE_BOUNDARIES", str(path))
    expect_error(["AUTOOFFLOAD_ROLE_BOUNDARIES", str(path), "not valid YAML"])


def test_unknown_env_var_suggests_the_right_one(monkeypatch):
    monkeypatch.setenv("AUTOOFFLOAD_BUDJET", "12GiB")
    expect_error(["AUTOOFFLOAD_BUDJET", "'12GiB'", "did you mean AUTOOFFLOAD_BUDGET?"])


def test_unknown_env_var_without_close_match_lists_valid_ones(monkeypatch):
    monkeypatch.setenv("AUTOOFFLOAD_ZZZ", "1")
    error = expect_error(["AUTOOFFLOAD_ZZZ", "valid variables", "AUTOOFFLOAD_BUDGET"])
    assert "did you mean" not in str(error)


def test_unknown_kwarg_suggests_the_right_one():
    expect_error(["budjet", "did you mean budget?", "valid settings"], budjet="12GiB")


def test_kwargs_override_env_and_a_bad_env_value_they_override_is_not_read(monkeypatch):
    monkeypatch.setenv("AUTOOFFLOAD_BUDGET", "8GiB")
    monkeypatch.setenv("AUTOOFFLOAD_LOG", "warning")
    s = Settings.from_env(budget="2GiB")
    assert s.budget == 2 * GiB and s.log == "warning"
    monkeypatch.setenv("AUTOOFFLOAD_BUDGET", "lots")
    assert Settings.from_env(budget=0.5).budget == 0.5


def test_empty_env_var_means_unset(monkeypatch):
    monkeypatch.setenv("AUTOOFFLOAD_BUDGET", "")
    monkeypatch.setenv("AUTOOFFLOAD", " ")
    s = Settings.from_env()
    assert s.budget is None and s.enabled is True


def test_master_switch_env_is_plain_autooffload(monkeypatch):
    monkeypatch.setenv("AUTOOFFLOAD", "0")
    assert Settings.from_env().enabled is False


def test_settings_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings().budget = 1  # type: ignore[misc]


def test_direct_construction_validates_with_the_kwarg_name():
    with pytest.raises(SettingsError, match=r"n_swap=-2"):
        Settings(n_swap=-2)
    with pytest.raises(SettingsError, match=r"cache_dir="):
        Settings(cache_dir="")


def test_every_error_is_a_settings_error_and_a_value_error():
    with pytest.raises(ValueError):
        Settings(log="loud")


def test_resolve_bytes():
    assert Settings.resolve_bytes(None, 80 * GiB) is None
    assert Settings.resolve_bytes(0.5, 80 * GiB) == 40 * GiB
    assert Settings.resolve_bytes("12GiB", 80 * GiB) == 12 * GiB
    assert Settings.resolve_bytes(GiB, 80 * GiB) == GiB
    with pytest.raises(SettingsError):
        Settings.resolve_bytes("lots", GiB)


def test_current_is_none_until_enabled():
    assert settings_module.current() is None


def test_docstring_documents_every_field():
    documented = set(re.findall(r"^        (\w+): ", Settings.__doc__ or "", flags=re.M))
    assert documented == {f.name for f in dataclasses.fields(Settings)}


def test_every_env_var_is_prefixed_and_unique():
    envs = [env for env, _, _ in settings_module.env_vars()]
    assert len(envs) == len(set(envs)) == len(dataclasses.fields(Settings))
    assert all(env == "AUTOOFFLOAD" or env.startswith("AUTOOFFLOAD_") for env in envs)


def test_readme_env_table_is_generated_from_settings():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = settings_module.markdown_env_table()
    assert table in readme, (
        "README.md's env var table is out of date; regenerate it with "
        "python -c 'from autooffload.settings import markdown_env_table as t; print(t())'"
    )
    for field in dataclasses.fields(Settings):
        assert f"`{field.metadata['env']}`" in readme


def test_cpu_threads_must_be_positive():
    expect_error(["cpu_threads=0", ">= 1"], cpu_threads=0)
    assert Settings.from_env(cpu_threads="3").cpu_threads == 3
