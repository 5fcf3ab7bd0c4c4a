"""TRL's own ``trl/scripts/sft.py``, run unchanged from where TRL installs it, through
``python -m autooffload`` in the CPU simulation: with masking off its losses equal the plain
script's, and with masking on its labels are -100 exactly outside the assistant turns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from tiny_qwen3 import tiny_qwen3  # noqa: E402
from tokenizer_data import tokenizer_dir  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
STEPS = 3

# Runs sft.py as its own __main__ after recording what each training step's loss saw.
DRIVER = textwrap.dedent(
    """
    import os, runpy, sys

    import torch
    import trl
    from transformers import trainer

    SFT = os.path.join(os.path.dirname(trl.__file__), "scripts", "sft.py")
    original = trainer.Trainer.training_step
    steps = []


    def training_step(self, model, inputs, *args, **kwargs):
        record = {k: inputs[k].detach().cpu().clone() for k in ("input_ids", "labels")}
        loss = original(self, model, inputs, *args, **kwargs)
        steps.append({**record, "loss": float(loss.detach())})
        torch.save(steps, os.environ["SFT_STEPS"])
        return loss


    trainer.Trainer.training_step = training_step
    sys.argv = [SFT, *sys.argv[1:]]
    runpy.run_path(SFT, run_name="__main__")
    """
)

CONVERSATIONS = [
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": f"What is {a}+{b}?"},
        {"role": "assistant", "content": f"It is {a + b}."},
        {"role": "user", "content": "And doubled?"},
        {"role": "assistant", "content": f"That makes {2 * (a + b)}."},
    ]
    for a, b in [(2, 2), (3, 5), (7, 1), (4, 4), (9, 2), (6, 3)]
]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A random-init tiny Qwen3 saved with its tokenizer, and a local chat data set."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("sft_script")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir("qwen3"))
    tiny_qwen3(len(tokenizer)).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    data = root / "data"
    data.mkdir()
    rows = "".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS)
    (data / "train.jsonl").write_text(rows)
    (root / "driver.py").write_text(DRIVER)
    return root


def _sft(root: Path, name: str, launcher: list[str], env: dict[str, str]) -> tuple[list[dict], str]:
    steps = root / f"{name}.pt"
    base = {k: v for k, v in os.environ.items() if not k.startswith("AUTOOFFLOAD")}
    base.update(PYTHONPATH=str(REPO), SFT_STEPS=str(steps), CUDA_VISIBLE_DEVICES="", **env)
    args = [
        "--model_name_or_path", str(root / "model"),
        "--dataset_name", str(root / "data"),
        "--output_dir", str(root / f"out-{name}"),
        "--max_steps", str(STEPS),
        "--per_device_train_batch_size", "2",
        "--learning_rate", "1e-3",
        "--logging_steps", "1",
        "--save_strategy", "no",
        "--report_to", "none",
        "--use_cpu", "true",
        "--bf16", "false",
        "--dtype", "float32",
        "--seed", "0",
        "--disable_tqdm", "true",
    ]  # fmt: skip
    result = subprocess.run(
        [sys.executable, *launcher, str(root / "driver.py"), *args],
        capture_output=True,
        text=True,
        cwd=root,
        env=base,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    recorded = torch.load(steps)
    assert len(recorded) == STEPS
    return recorded, result.stderr


def _trained_spans(tokenizer, ids: torch.Tensor, labels: torch.Tensor) -> list[str]:
    """The text of each run of positions whose label is kept."""
    spans, run = [], []
    for token, label in zip(ids.tolist(), labels.tolist()):
        if label != -100:
            run.append(token)
        elif run:
            spans.append(tokenizer.decode(run))
            run = []
    return spans + ([tokenizer.decode(run)] if run else [])


@pytest.mark.slow
def test_trl_sft_script_runs_unchanged_through_the_launcher(workspace):
    from transformers import AutoTokenizer

    attach = ["-m", "autooffload", "--force-attach"]
    offload = {"AUTOOFFLOAD_N_PERSIST": "0"}
    plain, _ = _sft(workspace, "plain", [], {})
    unmasked, _ = _sft(workspace, "unmasked", attach, {**offload, "AUTOOFFLOAD_MASK": "0"})
    masked, log = _sft(workspace, "masked", attach, offload)

    # Masking off: the same batches, labels and losses as the plain script.
    for step, (want, got) in enumerate(zip(plain, unmasked)):
        assert torch.equal(got["input_ids"], want["input_ids"]), step
        assert torch.equal(got["labels"], want["labels"]), step
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-5), step
    assert "[autooffload]" in log and "offloaded" in log, log[-3000:]

    # Masking on: exactly the assistant answers (and their end markers) keep their labels.
    tokenizer = AutoTokenizer.from_pretrained(workspace / "model")
    answers = {tuple(m["content"] for m in c if m["role"] == "assistant"): c for c in CONVERSATIONS}
    for step in masked:
        for ids, labels in zip(step["input_ids"], step["labels"]):
            spans = _trained_spans(tokenizer, ids, labels)
            assert len(spans) == 2, spans
            first, second = (s.removesuffix("<|im_end|>") for s in spans)
            second = second.removeprefix("<think>\n\n</think>\n\n")
            assert (first, second) in answers, spans
            assert all(s.endswith("<|im_end|>") for s in spans), spans
    kept = int((masked[0]["labels"] != -100).sum())
    total = int((plain[0]["labels"] != -100).sum())
    assert 0 < kept < total
    lines = [line for line in log.splitlines() if "masking:" in line]
    assert len(lines) == 1 and f"keeps {kept} of {total} label tokens" in lines[0], lines
