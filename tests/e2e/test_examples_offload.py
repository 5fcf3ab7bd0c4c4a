"""The README's quick start offloads on a CPU-only machine (the CPU simulation), prints one plan
in the simulation's words, and trains like plain training."""

from __future__ import annotations

import re
import shlex

import pytest
from test_examples import REPO, run, step_losses

pytestmark = pytest.mark.slow

PLAN_LINE = r"^(\[autooffload\] )?plan \((search|user\+search)\): \d+ chunks"


def readme_quick_start() -> tuple[dict[str, str], list[str]]:
    """The README's command running ``examples/plain_torch.py``: its ``VAR=value`` prefix and
    the arguments after ``python``."""
    lines = (REPO / "README.md").read_text().splitlines()
    (line,) = [line for line in lines if "python examples/plain_torch.py" in line]
    command = shlex.split(line.split("&&")[-1].split("#")[0])
    env = {}
    while "=" in command[0]:
        name, value = command.pop(0).split("=", 1)
        env[name] = value
    assert command[0] == "python", line
    return env, command[1:]


def test_readme_quick_start_offloads_on_a_cpu_and_trains_like_plain_training():
    env, args = readme_quick_start()
    output = run(*args, env={**env, "CUDA_VISIBLE_DEVICES": ""}, log=True)
    assert len(re.findall(PLAN_LINE, output, flags=re.M)) == 1, output
    assert "the next 2 optimizer steps (1 if the first takes 20 s or more) are profiling" in output
    streamed = re.search(
        r"^  persistent on device: \d+ chunks; offloaded to host memory: (\d+)", output, flags=re.M
    )
    assert streamed and int(streamed.group(1)) > 0, output
    blocks = re.search(
        r"^  activations: \d+ blocks keep, (\d+) checkpoint.*, (\d+) swap", output, flags=re.M
    )
    assert blocks and int(blocks.group(1)) + int(blocks.group(2)) > 0, output
    assert "GPU" not in output, output
    losses = step_losses(output)
    attached, plain = losses[: len(losses) // 2], losses[len(losses) // 2 :]
    assert len(attached) == 5 and attached == pytest.approx(plain, rel=1e-4, abs=1e-5)
    (last,) = [line for line in output.splitlines() if line.startswith("summary: ")]
    assert re.match(r"summary: plain training needs [\d.]+ MiB on the device", last), last
    assert "losses equal plain training's" in last, last


def test_print_plan_prints_the_searched_plan_once_and_stops_after_profiling():
    output = run(
        "-m",
        "autooffload",
        "--print-plan",
        "examples/plain_torch.py",
        "--steps",
        "6",
        env={"AUTOOFFLOAD_FORCE_ATTACH": "1", "AUTOOFFLOAD_DEVICE": "cpu"},
        log=True,
    )
    assert len(re.findall(PLAN_LINE, output, flags=re.M)) == 1, output
    # Two profiling steps run; the script stops before its third step's loss is printed.
    assert len(step_losses(output)) == 2, output
