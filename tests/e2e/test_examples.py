"""The examples run end to end on CPU, offline, directly and through the launcher."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def run(*args: str, env: dict[str, str] | None = None, log: bool = False) -> str:
    """Run ``python *args`` from the repo root, offline; return stdout (then stderr, where
    autooffload logs, with ``log``), failing on a bad exit."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("AUTOOFFLOAD")}
    # The repo first, then the caller's PYTHONPATH (a pip --target dir, say).
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    base.update(PYTHONPATH=pythonpath, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**base, **(env or {})},
        timeout=600,
    )
    assert result.returncode == 0, f"{args} exited {result.returncode}:\n{result.stderr[-4000:]}"
    return f"{result.stdout}\n{result.stderr}" if log else result.stdout


def step_losses(stdout: str) -> list[float]:
    return [float(m) for m in re.findall(r"^step \d+/\d+ loss ([\d.]+)$", stdout, flags=re.M)]


def trainer_losses(stdout: str) -> list[float]:
    (line,) = [line for line in stdout.splitlines() if line.startswith("losses:")]
    return [float(value) for value in line.split()[1:]]


def test_plain_torch_trains_and_says_it_did_not_attach_a_small_model():
    stdout = run("examples/plain_torch.py", "--steps", "4")
    losses = step_losses(stdout)
    assert len(losses) == 4
    assert losses[-1] < losses[0], "the loss should fall on the repeated batch"
    last = stdout.splitlines()[-1]
    assert last.startswith("summary: ") and "did not attach" in last, last


def test_plain_torch_through_the_launcher_and_switched_off():
    launched = step_losses(run("-m", "autooffload", "--budget", "1GiB", "examples/plain_torch.py"))
    switched_off = step_losses(run("examples/plain_torch.py", env={"AUTOOFFLOAD": "0"}))
    assert len(launched) == len(switched_off) == 5
    assert launched == pytest.approx(switched_off, rel=1e-4)


def test_hf_trainer_example():
    losses = trainer_losses(run("examples/hf_trainer.py", "--steps", "3"))
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)


def test_trl_sft_example():
    losses = trainer_losses(run("examples/trl_sft.py", "--steps", "3"))
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)


def test_trl_dpo_example_attaches_policy_and_reference_and_trains_like_plain():
    plain = run("examples/trl_dpo.py", "--steps", "3")
    simulated = {"AUTOOFFLOAD_FORCE_ATTACH": "1", "AUTOOFFLOAD_DEVICE": "cpu"}
    attached = run("-m", "autooffload", "examples/trl_dpo.py", "--steps", "3", env=simulated)
    assert "policy attached: False; reference attached: False" in plain
    assert "policy attached: True; reference attached: True" in attached
    expected, losses = trainer_losses(plain), trainer_losses(attached)
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses), losses
    assert losses == pytest.approx(expected, rel=1e-4)
