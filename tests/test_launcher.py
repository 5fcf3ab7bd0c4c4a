"""Tests of autooffload/__main__.py: argv, sys.path, exit codes, exceptions, -m, --, --help."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from autooffload.__main__ import _split
from autooffload.settings import env_vars

REPO = Path(__file__).resolve().parents[1]

REPORT = textwrap.dedent(
    """
    import json, os, sys
    import autooffload
    from autooffload.settings import current

    active = current()
    again = autooffload.enable() if active is not None else None
    print(json.dumps({
        "name": __name__,
        "argv": sys.argv,
        "path0": sys.path[0],
        "enabled": active is not None,
        "budget": active and active.budget,
        "offload": active and active.offload,
        "mask": active and active.mask,
        "print_plan": active and active.print_plan,
        "log": active and active.log,
        "env_mask": os.environ.get("AUTOOFFLOAD_MASK"),
        "enable_again_is_same": again is active,
    }))
    """
)


def launch(*args: str, cwd: Path = REPO, env: dict[str, str] | None = None):
    """Run ``python -m autooffload *args`` and return the completed process."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("AUTOOFFLOAD")}
    base["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "autooffload", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**base, **(env or {})},
        timeout=300,
    )


def report_of(result) -> dict:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture
def script(tmp_path) -> Path:
    folder = tmp_path / "scripts"
    folder.mkdir()
    path = folder / "train.py"
    path.write_text(REPORT)
    return path


@pytest.mark.parametrize(
    ("argv", "own", "rest"),
    [
        (["t.py", "--budget", "1"], [], ["t.py", "--budget", "1"]),
        (["--budget", "2GiB", "--no-mask", "t.py", "-x"], ["--budget", "2GiB", "--no-mask"], None),
        (["--budget=2GiB", "t.py"], ["--budget=2GiB"], ["t.py"]),
        (["--log", "debug", "--", "--weird.py", "a"], ["--log", "debug"], ["--weird.py", "a"]),
        (["--print-plan", "-m", "pkg.mod", "-m", "x"], ["--print-plan", "-m", "pkg.mod"], None),
        (["-mpkg", "a"], ["-mpkg"], ["a"]),
        (["--help"], ["--help"], []),
    ],
)
def test_split_stops_at_the_script_or_module(argv, own, rest):
    got_own, got_rest = _split(argv)
    assert got_own == own
    assert got_rest == (rest if rest is not None else argv[len(own) :])


def test_script_sees_its_argv_path_and_name_and_launcher_options(script):
    result = launch("--budget", "2GiB", "--no-mask", str(script), "--budget", "x", "-m", "y")
    report = report_of(result)
    assert report["name"] == "__main__"
    assert report["argv"] == [str(script), "--budget", "x", "-m", "y"]
    assert report["path0"] == str(script.parent)
    assert report["enabled"] is True
    assert report["budget"] == 2 << 30
    assert report["mask"] is False and report["env_mask"] == "0"
    assert report["enable_again_is_same"] is True


def test_double_dash_equals_form_and_flags(script):
    result = launch(
        "--budget=0.5", "--no-offload", "--print-plan", "--log", "warning", "--", str(script), "-q"
    )
    report = report_of(result)
    assert report["argv"] == [str(script), "-q"]
    assert report["budget"] == 0.5
    assert (report["offload"], report["print_plan"], report["log"]) == (False, True, "warning")


def test_relative_script_path_is_kept_as_given(script):
    report = report_of(launch("scripts/train.py", "a", cwd=script.parent.parent))
    assert report["argv"] == ["scripts/train.py", "a"]
    assert report["path0"] == str(script.parent)


def test_env_toggles_are_honoured(script):
    report = report_of(launch(str(script), env={"AUTOOFFLOAD_BUDGET": "3GiB"}))
    assert report["budget"] == 3 << 30


def test_autooffload_0_runs_the_script_with_nothing_enabled(script):
    report = report_of(launch(str(script), "a", env={"AUTOOFFLOAD": "0"}))
    assert report["enabled"] is False
    assert report["argv"] == [str(script), "a"]


@pytest.mark.parametrize(
    ("body", "code", "stderr"),
    [
        ("import sys; sys.exit(3)", 3, ""),
        ("import sys; sys.exit('fatal: bad input')", 1, "fatal: bad input"),
        ("print('done')", 0, ""),
        ("raise SystemExit(0)", 0, ""),
    ],
)
def test_exit_codes_pass_through(tmp_path, body, code, stderr):
    path = tmp_path / "exits.py"
    path.write_text(body + "\n")
    result = launch(str(path))
    assert result.returncode == code
    assert stderr in result.stderr


def test_uncaught_exception_prints_its_traceback_and_exits_1(tmp_path):
    path = tmp_path / "boom.py"
    path.write_text("def train():\n    raise ValueError('boom at step 3')\n\ntrain()\n")
    result = launch(str(path))
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert f'File "{path}", line 2, in train' in result.stderr
    assert result.stderr.rstrip().endswith("ValueError: boom at step 3")


def _python(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def _without_library_noise(stderr: str) -> str:
    """stderr less lines libraries print on import (bitsandbytes' kernel notice)."""
    return "\n".join(line for line in stderr.splitlines() if "kernels-community" not in line)


@pytest.mark.parametrize("form", ["script", "module"])
def test_a_failing_script_shows_what_python_shows(tmp_path, form):
    (tmp_path / "failing.py").write_text(
        "import json\n\ndef train():\n    json.loads('{')\n\ntrain()\n"
    )
    target = ["failing.py"] if form == "script" else ["-m", "failing"]
    plain = _python(*target, cwd=tmp_path)
    launched = launch(*target, cwd=tmp_path)
    assert launched.returncode == plain.returncode == 1
    # python -m shows runpy's two frames before the module's; the launcher shows none.
    expected_lines = [line for line in plain.stderr.splitlines() if "<frozen runpy>" not in line]
    assert "autooffload" not in _without_library_noise(launched.stderr), launched.stderr
    assert _without_library_noise(launched.stderr).splitlines() == expected_lines


def test_a_missing_module_is_one_line_as_in_python(tmp_path):
    plain = _python("-m", "no_such_module_here", cwd=tmp_path)
    launched = launch("-m", "no_such_module_here", cwd=tmp_path)
    assert launched.returncode == plain.returncode == 1
    assert _without_library_noise(launched.stderr) == plain.stderr.rstrip("\n")
    assert len(plain.stderr.splitlines()) == 1


def test_force_attach_flag_sets_its_env_var(tmp_path):
    (tmp_path / "show.py").write_text(
        "import os\nfrom autooffload.settings import current\n"
        "print(os.environ['AUTOOFFLOAD_FORCE_ATTACH'], current().force_attach)\n"
    )
    result = launch("--force-attach", "show.py", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "True"]


def test_dash_m_runs_a_module_as_main(tmp_path):
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "job.py").write_text(REPORT)
    for form in (["-m", "mypkg.job"], ["-mmypkg.job"]):
        report = report_of(launch("--budget", "1GiB", *form, "--flag", "v", cwd=tmp_path))
        assert report["name"] == "__main__"
        assert report["argv"] == [str(package / "job.py"), "--flag", "v"]
        assert report["budget"] == 1 << 30


def test_bad_setting_stops_before_the_script_runs(script):
    result = launch("--budget", "lots", str(script))
    assert result.returncode == 2
    assert "AUTOOFFLOAD_BUDGET='lots'" in result.stderr and "12GiB" in result.stderr
    assert result.stdout == ""


def test_misspelled_env_var_stops_before_the_script_runs(script):
    result = launch(str(script), env={"AUTOOFFLOAD_BUDJET": "1GiB"})
    assert result.returncode == 2
    assert "did you mean AUTOOFFLOAD_BUDGET?" in result.stderr
    assert result.stdout == ""


def test_missing_or_no_script_is_a_usage_error(tmp_path):
    missing = launch(str(tmp_path / "nope.py"))
    assert missing.returncode == 2 and "can't open file" in missing.stderr
    nothing = launch("--budget", "1GiB")
    assert nothing.returncode == 2 and "script" in nothing.stderr


def test_help_documents_every_option_and_env_var():
    result = launch("--help")
    assert result.returncode == 0
    options = ("--budget", "--no-offload", "--force-attach", "--no-mask", "--print-plan", "--log")
    for option in (*options, "-m MODULE"):
        assert option in result.stdout
    for env, default, _ in env_vars():
        line = next(line for line in result.stdout.splitlines() if line.split()[:1] == [env])
        assert f"(default: {default})" in line
