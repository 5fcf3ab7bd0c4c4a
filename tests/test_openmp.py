"""Tests of autooffload/openmp.py: OpenMP's wait policy is passive where it still can be, and a
warning says what to do where it cannot (torch loaded OpenMP before ``enable()``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from autooffload import log, openmp

REPO = Path(__file__).resolve().parents[1]


def _run(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != openmp.ENV}
    clean.update(env)
    clean["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), clean.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=clean,
        timeout=120,
        check=True,
    )
    return done.stdout.strip()


def test_enable_before_torch_asks_for_passive_waiting_and_torch_sees_it():
    out = _run(
        """
        import os, sys
        import autooffload
        autooffload.enable()
        assert "torch" in sys.modules  # the patches loaded it, after the variable was set
        print(os.environ.get("OMP_WAIT_POLICY"))
        """
    )
    assert out == "PASSIVE"


def test_a_policy_the_user_chose_is_left_alone():
    out = _run(
        """
        import os, autooffload
        autooffload.enable()
        print(os.environ["OMP_WAIT_POLICY"])
        """,
        OMP_WAIT_POLICY="ACTIVE",
    )
    assert out == "ACTIVE"


def test_torch_imported_first_leaves_the_variable_unset():
    # Setting it then would change nothing (libgomp read the environment when torch loaded it)
    # and would hide the warning's reason from the user.
    out = _run(
        """
        import os, torch, autooffload
        autooffload.enable()
        print(os.environ.get("OMP_WAIT_POLICY"))
        """
    )
    assert out == "None"


def test_the_spinning_warning_is_one_line_once_and_names_the_fix(monkeypatch):
    monkeypatch.delenv(openmp.ENV, raising=False)
    log.reset_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        openmp.warn_if_spinning()
        openmp.warn_if_spinning()
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "\n" not in messages[0]
    assert "OMP_WAIT_POLICY=PASSIVE" in messages[0] and "python -m autooffload" in messages[0]
    log.reset_warnings()


@pytest.mark.parametrize("policy", ["PASSIVE", "ACTIVE"])
def test_no_warning_once_a_policy_is_set(monkeypatch, policy):
    monkeypatch.setenv(openmp.ENV, policy)
    log.reset_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        openmp.warn_if_spinning()
    assert not caught
