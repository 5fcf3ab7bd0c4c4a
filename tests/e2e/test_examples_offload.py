"""The main example runs with its model attached (CPU simulation) and trains like the plain run."""

from __future__ import annotations

import re

import pytest
from test_examples import run, step_losses

pytestmark = pytest.mark.slow


def test_plain_torch_attached_in_cpu_simulation_matches_plain_training():
    attached = run(
        "examples/plain_torch.py",
        "--steps",
        "4",
        env={"AUTOOFFLOAD_FORCE_ATTACH": "1", "AUTOOFFLOAD_DEVICE": "cpu"},
    )
    plain = run("examples/plain_torch.py", "--steps", "4", env={"AUTOOFFLOAD": "0"})
    assert re.search(r"plan \((search|user\+search)\): \d+ chunks", attached), attached[-2000:]
    assert step_losses(attached) == pytest.approx(step_losses(plain), rel=1e-4, abs=1e-5)


def test_print_plan_prints_the_searched_plan_and_stops_after_profiling():
    stdout = run(
        "-m",
        "autooffload",
        "--print-plan",
        "examples/plain_torch.py",
        "--steps",
        "6",
        env={"AUTOOFFLOAD_FORCE_ATTACH": "1", "AUTOOFFLOAD_DEVICE": "cpu"},
    )
    assert re.search(r"^plan \((search|user\+search)\): \d+ chunks", stdout, flags=re.M), stdout
    # Two profiling steps run; the script stops before its third step's loss is printed.
    assert len(step_losses(stdout)) == 2, stdout
