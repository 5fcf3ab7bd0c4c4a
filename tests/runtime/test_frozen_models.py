"""Frozen models (nothing requires grad: a DPO reference model, a distillation teacher) attach
and stream their chunks (``Settings.offload_frozen``), in the CPU simulation."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

import autooffload
from autooffload import runtime as rt
from autooffload.errors import AttachError
from autooffload.runtime.control.profiler import MARKS_PER_GROUP, StepProfiler

pytestmark = pytest.mark.usefixtures("one_thread")


def _bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@contextmanager
def _info_lines() -> Iterator[list[str]]:
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("autooffload")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_a_frozen_model_attaches_streams_and_gives_the_plain_logits(
    make_llama, offload_cpu, make_batches
):
    plain = make_llama(n_layers=3, seed=3).eval()
    model = make_llama(n_layers=3, seed=3).requires_grad_(False).eval()
    offload_cpu()  # force_attach: a frozen model attaches whatever its size
    with _info_lines() as lines:
        model.to("cpu")
    runtime = rt.runtime_of(model)
    assert runtime is not None, "a frozen model was not attached"
    assert runtime.plan.n_persist == 0
    assert all(runtime.is_offloaded(p) for p in model.parameters())
    assert not runtime.cpu_optim.offloaded_ids and runtime.manager.grads.staging.total_bytes == 0
    frozen = [line for line in lines if line.startswith("frozen LlamaForCausalLM")]
    assert len(frozen) == 1 and f"{runtime.plan.n_chunks} of" in frozen[0], lines
    for ids in make_batches(2):
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits)
    ids = make_batches(1)[0]
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits)
    mask = torch.ones_like(ids[:, :4])
    greedy = dict(max_new_tokens=5, do_sample=False, attention_mask=mask, pad_token_id=0)
    expected = plain.generate(ids[:, :4], **greedy)
    assert torch.equal(model.generate(ids[:, :4], **greedy), expected)


def test_offload_frozen_off_leaves_a_frozen_model_whole(make_llama, offload_cpu):
    model = make_llama().requires_grad_(False)
    offload_cpu(offload_frozen=False)
    model.to("cpu")
    assert rt.runtime_of(model) is None
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())


@pytest.mark.parametrize(("budget_share", "attached"), [(3, True), (5, False)])
def test_auto_attaches_a_frozen_model_from_a_quarter_of_the_budget(
    make_llama, offload_cpu, budget_share, attached
):
    model = make_llama().requires_grad_(False)
    size = _bytes(model)
    offload_cpu(force_attach=False, attach_threshold=size, budget=budget_share * size)
    model.to("cpu")
    assert (rt.runtime_of(model) is not None) is attached


def test_offload_frozen_on_attaches_a_frozen_model_over_the_threshold_only(make_llama, offload_cpu):
    small, large = make_llama(hidden=32), make_llama(hidden=64)
    for model in (small, large):
        model.requires_grad_(False)
    offload_cpu(force_attach=False, offload_frozen=True, attach_threshold=_bytes(large))
    small.to("cpu")
    large.to("cpu")
    assert rt.runtime_of(small) is None and rt.runtime_of(large) is not None


def _distill(make_llama, make_batches, attach: bool) -> tuple[list[float], dict, object]:
    student = make_llama(n_layers=2, seed=0)
    teacher = make_llama(n_layers=3, seed=1).requires_grad_(False).eval()
    if attach:
        autooffload.enable(
            device="cpu", force_attach=True, chunk_size=20_000, mask=False, log="warning"
        )
    student.to("cpu")
    teacher.to("cpu")
    assert (rt.runtime_of(teacher) is not None) is attach
    assert (rt.runtime_of(student) is not None) is attach
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-2, fused=True)
    losses = []
    for ids in make_batches(12):
        # The teacher's forward outside no_grad, as scripts sometimes write it: nothing in it
        # requires grad, so no graph is built and no backward or step ever profiles it.
        target = teacher(input_ids=ids).logits.log_softmax(-1)
        logits = student(input_ids=ids).logits
        loss = F.kl_div(logits.log_softmax(-1), target, log_target=True, reduction="batchmean")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    teacher_runtime = rt.runtime_of(teacher)
    weights = {k: v.detach().clone() for k, v in student.state_dict().items()}
    return losses, weights, teacher_runtime


def test_a_frozen_teacher_streams_while_the_student_trains_like_plain(make_llama, make_batches):
    expected, expected_weights, _ = _distill(make_llama, make_batches, attach=False)
    actual, weights, teacher = _distill(make_llama, make_batches, attach=True)
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    for name, value in expected_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert expected[-1] < expected[0], "the student did not learn: the comparison proves little"
    # Twelve grad-enabled teacher forwards and no step: its profiler keeps a bounded record.
    assert isinstance(teacher.control.profiler, StepProfiler)
    assert 0 < len(teacher.control.profiler.marks) <= MARKS_PER_GROUP * len(teacher.groups)
    assert teacher.plan.n_persist == 0 and teacher.plan.source == "profiling step"


def test_gradient_staging_is_pinned_only_once_something_trains(
    make_llama, offload_cpu, make_batches
):
    """A model attached with params that require grad but run under no_grad only (TRL's DPO
    reference, loaded by name) never allocates its gradient staging."""
    model = make_llama()
    offload_cpu(n_persist=0)
    model.to("cpu")
    staging = rt.runtime_of(model).manager.grads.staging
    ids = make_batches(1)[0]
    with torch.no_grad():
        model(input_ids=ids)
    assert staging.total_bytes > 0 and not staging.allocated
    model(input_ids=ids, labels=ids).loss.backward()
    assert staging.allocated and sum(p.numel() for p in staging.pieces) == staging.total_bytes


def test_unfreezing_a_model_attached_frozen_names_offload_frozen(
    make_llama, offload_cpu, make_batches
):
    model = make_llama().requires_grad_(False)
    offload_cpu()
    model.to("cpu")
    ids = make_batches(1)[0]
    model.requires_grad_(True)
    with pytest.raises(AttachError) as error:
        model(input_ids=ids, labels=ids)
    assert "AUTOOFFLOAD_OFFLOAD_FROZEN=0" in str(error.value)
