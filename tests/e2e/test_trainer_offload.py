"""HF Trainer runs unchanged on an attached model (CPU simulation): it learns, its checkpoints
reload into a plain model, and ``resume_from_checkpoint`` continues the run it was cut from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import autooffload
from autooffload import runtime as rt
from autooffload.errors import AttachError

VOCAB = 128
SEQ = 16
STEPS = 8
# Two runs of the same fp32 math; only summation order (clip norm over GPU and host parts)
# differs. A lost optimizer state or data-order slip on resume moves weights by ~lr = 1e-2.
RTOL = 1e-4
ATOL = 1e-5


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def dataset() -> list[dict[str, torch.Tensor]]:
    """Eight sequences of random tokens: memorised over the epochs, so the loss must fall."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(8):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=generator)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def trainer(output_dir: Path, seed: int, **changes: object) -> Trainer:
    """A Trainer over a fresh model (``changes``: TrainingArguments to override); the move to
    the device inside attaches it."""
    settings: dict = {
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "learning_rate": 2e-2,
        "max_grad_norm": 0.5,
        "lr_scheduler_type": "linear",
        "logging_steps": 1,
        "save_steps": 4,
        "save_strategy": "steps",
        **changes,
    }
    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=STEPS,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        **settings,
    )
    return Trainer(model=tiny_llama(seed), args=args, train_dataset=dataset())


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_trainer_checkpoints_reload_and_resume_like_an_uninterrupted_run(tmp_path: Path) -> None:
    autooffload.enable(
        device="cpu", force_attach=True, chunk_size=20_000, n_persist=1, mask=False, log="warning"
    )
    full = trainer(tmp_path / "full", seed=0)
    assert rt.runtime_of(full.model) is not None, "the Trainer's move to cpu did not attach"
    full.train()
    losses = [entry["loss"] for entry in full.state.log_history if "loss" in entry]
    assert len(losses) == STEPS
    # ln(128) = 4.85 at the start; memorising eight sequences takes it well below that.
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.3, losses
    expected = weights(full.model)
    ids = dataset()[0]["input_ids"][None]
    with torch.no_grad():
        attached_logits = full.model(input_ids=ids).logits

    resumed = trainer(tmp_path / "full", seed=1)  # other init: only the checkpoint can fix it
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-4"))
    actual = weights(resumed.model)
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=RTOL, atol=ATOL, msg=name)

    autooffload.disable()
    plain = LlamaForCausalLM.from_pretrained(tmp_path / "full" / f"checkpoint-{STEPS}")
    with torch.no_grad():
        plain_logits = plain(input_ids=ids).logits
    torch.testing.assert_close(plain_logits, attached_logits, rtol=RTOL, atol=ATOL)


def test_trainer_without_clipping_trains_like_plain_and_reads_the_gradient_norm(
    tmp_path: Path,
) -> None:
    """``max_grad_norm=0`` and no accumulation would suit the update in the backward, but the
    Trainer still takes the gradient norm for its logs (``clip_grad_norm_(params, inf)``)
    between backward and step: ``auto`` leaves the update at ``step()``, and the run ends
    where a plain Trainer run ends."""

    def run(output_dir: Path) -> Trainer:
        job = trainer(
            output_dir,
            seed=0,
            gradient_accumulation_steps=1,
            max_grad_norm=0.0,
            weight_decay=0.1,
            save_strategy="no",
        )
        job.train()
        return job

    expected = weights(run(tmp_path / "plain").model)
    autooffload.enable(
        device="cpu",
        force_attach=True,
        chunk_size=20_000,
        n_persist=1,
        activation_mode="keep",
        mask=False,
        log="warning",
    )
    job = run(tmp_path / "attached")
    runtime = rt.runtime_of(job.model)
    assert runtime is not None and runtime.cpu_optim.updates > 0
    # transformers 5.x logs the norm every step (``Trainer._get_grad_norm``); a version that
    # did not would leave the loop plain, and auto would take the update in the backward.
    reads_norm = hasattr(Trainer, "_get_grad_norm")
    assert runtime.backward_update.decided is (not reads_norm)
    assert runtime.cpu_optim.in_backward.persistent_armed is (not reads_norm)
    runtime.synchronize()
    actual = weights(job.model)
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=RTOL, atol=ATOL, msg=name)
    autooffload.disable()


def test_trainer_with_the_fused_head_logs_the_losses_of_a_plain_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fused_head`` on under the Trainer, two micro-batches a step and labels partly -100
    (one row entirely): every micro-batch is fused, its loss divided by the Trainer's
    ``num_items_in_batch``, and the logged losses and trained weights are a plain run's."""
    from autooffload.runtime.activations import fused_head

    def padded() -> list[dict[str, torch.Tensor]]:
        rows = dataset()
        for i, row in enumerate(rows):
            row["labels"][: 2 + i] = -100
        rows[3]["labels"][:] = -100
        return rows

    def run(output_dir: Path) -> Trainer:
        job = trainer(output_dir, seed=0, save_strategy="no")
        job.train_dataset = padded()
        job.train()
        return job

    plain = run(tmp_path / "plain")
    counts = []
    loss = fused_head.FusedHead.loss

    def counted(self, logits, labels, kwargs):
        counts.append(kwargs.get("num_items_in_batch"))
        return loss(self, logits, labels, kwargs)

    monkeypatch.setattr(fused_head.FusedHead, "loss", counted)
    autooffload.enable(
        device="cpu",
        force_attach=True,
        chunk_size=20_000,
        n_persist=1,
        fused_head=True,
        mask=False,
        log="warning",
    )
    job = run(tmp_path / "fused")
    assert rt.runtime_of(job.model).fused_head.fused_steps == 2 * STEPS
    assert len(counts) == 2 * STEPS and all(torch.is_tensor(n) for n in counts)

    def losses(run: Trainer) -> torch.Tensor:
        return torch.tensor([entry["loss"] for entry in run.state.log_history if "loss" in entry])

    torch.testing.assert_close(losses(job), losses(plain), rtol=RTOL, atol=ATOL)
    actual, expected = weights(job.model), weights(plain.model)
    autooffload.disable()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("optim", ["adafactor", "adamw_bnb_8bit"])
def test_trainer_optim_without_a_cpu_path_is_refused_before_a_step_naming_the_valid_values(
    tmp_path: Path, optim: str
) -> None:
    """An ``optim`` whose optimizer has no CPU twin stops ``train()`` before the first step,
    with the ``optim`` values that work."""
    if optim == "adamw_bnb_8bit":
        pytest.importorskip("bitsandbytes")
    autooffload.enable(
        device="cpu", force_attach=True, chunk_size=20_000, n_persist=1, mask=False, log="warning"
    )
    job = trainer(tmp_path, seed=0, optim=optim, save_strategy="no")
    before = weights(job.model)
    with pytest.raises(AttachError, match="HF Trainer: optim=adamw_torch_fused, adamw_torch, sgd"):
        job.train()
    assert job.state.global_step == 0
    for name, value in weights(job.model).items():
        assert torch.equal(value, before[name]), name
