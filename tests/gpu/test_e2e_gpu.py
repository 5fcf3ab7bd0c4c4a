"""On a GPU: every example trains a model that vanilla training cannot fit under a hard memory cap,
unchanged but for ``autooffload.enable()``; the loss falls, and the checkpoint it saves loads into
a plain model whose logits are the attached model's. The HF Trainer run uses gradient accumulation,
clipping, bf16 and ``save_steps``, and a second run resumes from its first checkpoint."""

from __future__ import annotations

import gc
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
CAPPED_RUN = Path(__file__).resolve().parent / "capped_run.py"
# The examples' "1b" size: TinyLlama-1.1B dimensions; 1.1B params in plain_torch.py (vocabulary
# 32000), 1.6B in the chat examples (the Qwen3 tokenizer's 151669 tokens, untied head); bf16.
SIZE = "1b"
CAP_BYTES = 6 << 30
# Vanilla full fine-tuning holds, per bf16 param, the weight (2 bytes), its grad (2) and AdamW's
# exp_avg and exp_avg_sq in the param dtype (2 + 2): 8 bytes, before any activation.
VANILLA_BYTES_PER_PARAM = 8
STEPS = 6
# The examples' default lr (1e-3, for the tiny model) swings the loss at hidden size 2048: on a
# 2-layer proxy of the chat model (CPU, bf16, accumulation 2) it went 12.2 7.2 12.4 15.3 7.0 5.9;
# at 1e-4 it went 12.2 7.8 5.0 7.0 4.1 5.8 (the ups and downs are batch-to-batch noise: few
# assistant tokens per batch).
LR = "1e-4"
# The examples' logits on a fixed sequence against a plain model's from the checkpoint, both under
# bf16 autocast: the same weights through the same kernels, equal or a few bf16 ulps apart (2**-8
# = 0.4% each) where cuBLAS picks another algorithm for differently aligned chunk views. Relative
# L2 error. A checkpoint of the untrained weights would give the logits of a loss of 12, not ~5.
LOGITS_RTOL = 1e-2
# The resumed Trainer run redoes steps 4-6 of the first run from its step-3 checkpoint, on the
# same batches. Both are bf16 on the GPU under plans that offload different chunks (fused CUDA
# and CPU AdamW may round the last bit differently), so not bitwise equal: tests/gpu/
# test_offload_gpu.py measured such runs' losses up to 1.4e-2 apart over 20 steps. A model that
# did not load the checkpoint starts again from ln(151669) = 11.9, against losses of ~4-7 here.
RESUME_LOSS_ATOL = 0.25


@pytest.fixture(autouse=True)
def _free_gpu_and_disk(tmp_path: Path):
    """Drop each test's checkpoints (up to ~30 GB) and the plain model's GPU memory."""
    yield
    shutil.rmtree(tmp_path, ignore_errors=True)
    gc.collect()
    torch.cuda.empty_cache()


def capped_run(script: str, *args: str) -> str:
    """Run ``examples/<script>`` at size 1b under the hard cap, offline, in a fresh process; return
    its stdout after checking it exited 0, attached the model and kept the cap to the end."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOOFFLOAD")}
    # The repo first, then the caller's PYTHONPATH (a pip --target dir, say).
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env.update(PYTHONPATH=pythonpath, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    command = [sys.executable, str(CAPPED_RUN), str(CAP_BYTES), f"examples/{script}"]
    result = subprocess.run(
        [*command, "--size", SIZE, "--lr", LR, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=600,
    )
    output = f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    assert result.returncode == 0, f"{script} {args} exited {result.returncode}:\n{output}"
    stdout = result.stdout
    # The plan is in the log (stderr) or, for the Trainer examples, also printed.
    both = f"{stdout}\n{result.stderr}"
    assert re.search(r"^(\[autooffload\] )?plan \([^)]*\): \d+ chunks", both, flags=re.M), output
    offloaded = re.search(
        r"^  persistent on GPU: \d+ chunks; offloaded to pinned CPU: (\d+)", both, flags=re.M
    )
    assert offloaded and int(offloaded.group(1)) > 0, f"nothing offloaded:\n{output}"
    (in_force,) = re.findall(r"^capped_run: cap in force at exit (\d+) bytes$", stdout, flags=re.M)
    assert int(in_force) == pytest.approx(CAP_BYTES, abs=1 << 20)
    return stdout


def losses_of(stdout: str) -> list[float]:
    """The per-step losses an example printed: its ``losses:`` line, else its ``step`` lines."""
    lines = [line for line in stdout.splitlines() if line.startswith("losses:")]
    if lines:
        return [float(value) for value in lines[-1].split()[1:]]
    return [float(m) for m in re.findall(r"^step \d+/\d+ loss ([\d.]+)$", stdout, flags=re.M)]


def assert_learns(losses: list[float]) -> None:
    assert len(losses) == STEPS and all(math.isfinite(loss) for loss in losses), losses
    last_half = losses[len(losses) // 2 :]
    assert sum(last_half) / len(last_half) < losses[0], losses


def assert_reloads_with_equal_logits(checkpoint: Path, dumped_logits: Path) -> None:
    """A plain model from ``checkpoint`` (no autooffload enabled in this process), too big for
    vanilla training under the cap, gives the attached model's logits on its fixed sequence."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).to("cuda")
    n_params = sum(p.numel() for p in model.parameters())
    vanilla_bytes = VANILLA_BYTES_PER_PARAM * n_params
    assert vanilla_bytes > CAP_BYTES, (
        f"{n_params / 1e9:.2f}B params need {vanilla_bytes / (1 << 30):.1f} GiB for vanilla"
        f" training: it fits the {CAP_BYTES / (1 << 30):.0f} GiB cap, so the test proves nothing"
    )
    dumped = torch.load(dumped_logits)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(input_ids=dumped["input_ids"].cuda()).logits.float().cpu()
    del model
    assert logits.shape == dumped["logits"].shape
    error = (logits - dumped["logits"]).norm() / dumped["logits"].norm()
    assert error <= LOGITS_RTOL, f"relative L2 error {error:.2e} of the reloaded model's logits"


def test_plain_torch_loop_trains_under_the_cap_and_its_save_reloads(tmp_path: Path) -> None:
    stdout = capped_run(
        "plain_torch.py",
        "--steps",
        str(STEPS),
        "--save",
        str(tmp_path / "model"),
        "--dump-logits",
        str(tmp_path / "logits.pt"),
    )
    assert_learns(losses_of(stdout))
    assert_reloads_with_equal_logits(tmp_path / "model", tmp_path / "logits.pt")


def test_hf_trainer_with_accumulation_clipping_and_bf16_saves_reloads_and_resumes(
    tmp_path: Path,
) -> None:
    common = ["--steps", str(STEPS), "--save-steps", str(STEPS // 2)]
    common += ["--grad-accum", "2", "--max-grad-norm", "1.0"]
    first_dir = tmp_path / "first"
    stdout = capped_run(
        "hf_trainer.py",
        *common,
        "--output-dir",
        str(first_dir),
        "--dump-logits",
        str(tmp_path / "logits.pt"),
    )
    losses = losses_of(stdout)
    assert_learns(losses)
    assert (first_dir / f"checkpoint-{STEPS // 2}").is_dir()
    assert_reloads_with_equal_logits(first_dir / f"checkpoint-{STEPS}", tmp_path / "logits.pt")
    shutil.rmtree(first_dir / f"checkpoint-{STEPS}")  # ~10 GB with the optimizer state

    resumed_dir = tmp_path / "resumed"
    stdout = capped_run(
        "hf_trainer.py",
        *common,
        "--output-dir",
        str(resumed_dir),
        "--resume",
        str(first_dir / f"checkpoint-{STEPS // 2}"),
    )
    state = json.loads((resumed_dir / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    assert state["global_step"] == STEPS
    # It started after step 3: no step-3 checkpoint of its own, and its log history carries the
    # first run's steps 1-3 from the checkpoint, then steps 4-6 of its own.
    assert not (resumed_dir / f"checkpoint-{STEPS // 2}").exists()
    logged = [(entry["step"], entry["loss"]) for entry in state["log_history"] if "loss" in entry]
    assert [step for step, _ in logged] == list(range(1, STEPS + 1)), logged
    resumed = losses_of(stdout)
    assert resumed[: STEPS // 2] == losses[: STEPS // 2]
    assert resumed[STEPS // 2 :] == pytest.approx(losses[STEPS // 2 :], abs=RESUME_LOSS_ATOL)


def test_trl_sft_trainer_trains_under_the_cap_and_its_checkpoint_reloads(tmp_path: Path) -> None:
    stdout = capped_run(
        "trl_sft.py",
        "--steps",
        str(STEPS),
        "--save-steps",
        str(STEPS),
        "--output-dir",
        str(tmp_path / "out"),
        "--dump-logits",
        str(tmp_path / "logits.pt"),
    )
    assert_learns(losses_of(stdout))
    assert_reloads_with_equal_logits(
        tmp_path / "out" / f"checkpoint-{STEPS}", tmp_path / "logits.pt"
    )


def test_accelerate_loop_trains_under_the_cap_and_its_saved_state_reloads(tmp_path: Path) -> None:
    stdout = capped_run(
        "accelerate_loop.py",
        "--steps",
        str(STEPS),
        "--grad-accum",
        "2",
        "--output-dir",
        str(tmp_path / "state"),
        "--dump-logits",
        str(tmp_path / "logits.pt"),
    )
    assert_learns(losses_of(stdout))
    # save_state's model.safetensors, with the config the example writes beside it.
    assert (tmp_path / "state" / "optimizer.bin").is_file()
    assert_reloads_with_equal_logits(tmp_path / "state", tmp_path / "logits.pt")
