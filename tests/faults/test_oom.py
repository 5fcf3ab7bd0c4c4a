"""A device OOM inside the attached model's forward or backward is retried once under a smaller
plan: the run ends with plain PyTorch's weights, the optimizer steps once per step, the new plan
is logged in one line; a second OOM, or one that cannot be retried, raises a clear error."""

from __future__ import annotations

import copy
import logging
from dataclasses import replace

import pytest
import torch
from _faults import (
    BATCH,
    VOCAB,
    Records,
    assert_same_weights,
    enable_cpu,
    no_offloaded_grad_on_device,
    offloaded_chunks_on_host,
    tiny_llama,
    weights,
    worker_idle,
)

import autooffload
from autooffload import runtime as rt
from autooffload.plan.search import make_plan
from autooffload.runtime.control.oom import REPROFILE_SOURCE, OutOfMemoryRetryError
from autooffload.runtime.control.oom_plan import (
    OOM_BUDGET_CUT,
    REPROFILE_RATIO,
    retry_budget,
    shrunk_plan,
)
from autooffload.runtime.control.planning import hardware_profile, profile_for_plan
from autooffload.runtime.step_state import StepPhase

STEPS = 6
# Long enough that activations weigh as much as the weights: a smaller plan exists.
LONG_SEQ = 64
OOM_MESSAGE = "CUDA out of memory. Tried to allocate 64.00 KiB. GPU 0 has a total capacity of"


class _OomInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, fault: OomFault) -> torch.Tensor:
        ctx.fault = fault
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.fault.fire():
            raise torch.OutOfMemoryError(OOM_MESSAGE)
        return grad, None


class OomFault:
    """Raises ``torch.OutOfMemoryError`` ``times`` times in the forward or backward of a block's
    MLP, as a real allocation failure there would."""

    def __init__(self, module: torch.nn.Module, where: str) -> None:
        self.where, self.times, self.raised = where, 0, 0
        module.register_forward_hook(self._hook)

    def fire(self) -> bool:
        if self.times <= 0:
            return False
        self.times -= 1
        self.raised += 1
        return True

    def _hook(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        if self.where == "forward" and self.fire():
            raise torch.OutOfMemoryError(OOM_MESSAGE)
        if self.where == "backward" and torch.is_grad_enabled() and self.times > 0:
            return _OomInBackward.apply(output, self)
        return output


def long_batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, LONG_SEQ), generator=generator) for _ in range(n)]


def with_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Attention dropout: the retried forward must draw the same random numbers."""
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    return model


def train(
    model: torch.nn.Module,
    attach: dict | None,
    where: str = "forward",
    fail_at: int = -1,
    times: int = 1,
    accum: int = 1,
) -> dict:
    runtime = None
    if attach is not None:
        enable_cpu(oom_retry=True, **attach)
        model.to("cpu")
        runtime = rt.runtime_of(model)
    fault = OomFault(model.model.layers[1].mlp, where)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    stepped = []
    optimizer.register_step_post_hook(lambda *a: stepped.append(1))
    data = long_batches(STEPS * accum)
    plans, losses = [], []
    torch.manual_seed(123)
    for step in range(STEPS):
        for micro in range(accum):
            index = step * accum + micro
            fault.times = times if index == fail_at else 0
            loss = model(input_ids=data[index], labels=data[index]).loss / accum
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
        if runtime is not None:
            plans.append(runtime.plan)
    assert fault.raised == (times if fail_at >= 0 else 0)
    return {
        "weights": weights(model),
        "losses": losses,
        "steps": len(stepped),
        "plans": plans,
        "runtime": runtime,
    }


# The update at step(): an OOM in a planned step's backward is retryable. (The auto mode turns
# the update in the backward on for these plain loops; then it is not:
# ``test_an_oom_after_updates_in_the_backward_is_not_retried_but_a_longer_batchs_is``.)
AT_STEP = {"update_in_backward": False}
SETTINGS = {
    # The searched plan: the retry checkpoints more blocks under a smaller budget.
    "searched-plan": (AT_STEP, 4),
    # During the conservative profiling steps: fewer streaming buffers.
    "profiling-step": ({}, 0),
    # Everything fixed by the user but the buffers.
    "fixed-plan": ({"n_persist": 1, "activation_mode": "keep", **AT_STEP}, 2),
}


def _copy(base: torch.nn.Module, attach: bool) -> torch.nn.Module:
    """A copy of ``base``, attached if ``attach``: one persistent chunk, activations kept, the
    OOM retry on."""
    model = copy.deepcopy(base)
    if attach:
        enable_cpu(oom_retry=True, n_persist=1, activation_mode="keep")
        model.to("cpu")
    return model


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("settings", list(SETTINGS), ids=list(SETTINGS))
def test_oom_is_retried_once_under_a_smaller_plan(settings, where):
    attach, fail_at = SETTINGS[settings]
    base = tiny_llama()
    if settings == "fixed-plan":
        # Not with a searched plan: its profiling step draws random numbers plain torch does not.
        with_dropout(base)
    plain = train(copy.deepcopy(base), None)
    records = Records()
    logging.getLogger("autooffload").addHandler(records)
    try:
        attached = train(copy.deepcopy(base), attach, where, fail_at)
    finally:
        logging.getLogger("autooffload").removeHandler(records)
    assert_same_weights(plain["weights"], attached["weights"])
    torch.testing.assert_close(torch.tensor(attached["losses"]), torch.tensor(plain["losses"]))
    assert attached["steps"] == plain["steps"] == STEPS
    runtime = attached["runtime"]
    assert runtime.oom.retries == 1
    before, after = attached["plans"][fail_at - 1 if fail_at else 0], attached["plans"][fail_at]
    if fail_at:
        assert after.knobs != before.knobs
    assert after.source == "OOM retry"
    lines = [line for line in records.lines if "out of memory" in line]
    assert len(lines) == 1, lines
    assert f"in {where}" in lines[0] and "n_buffer=" in lines[0] and "(was " in lines[0]
    # A profiling step's plan has no block policies: its blocks are checkpointed, not kept.
    profiling = "every block checkpointed (profiling)"
    assert (lines[0].count(profiling) == 2) == (settings == "profiling-step"), lines[0]
    assert offloaded_chunks_on_host(runtime) and worker_idle(runtime)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_second_oom_raises_a_clear_error(where):
    model = _copy(tiny_llama(), attach=True)
    runtime = rt.runtime_of(model)
    fault = OomFault(model.model.layers[1].mlp, where)
    ids = long_batches(1)[0]
    fault.times = 2
    with pytest.raises(OutOfMemoryRetryError) as raised:
        model(input_ids=ids, labels=ids).loss.backward()
    message = str(raised.value)
    assert "again after the retry" in message
    for words in ("budget", "n_persist=1", "AUTOOFFLOAD_BUDGET", "AUTOOFFLOAD_N_PERSIST"):
        assert words in message
    assert isinstance(raised.value, torch.OutOfMemoryError)
    assert offloaded_chunks_on_host(runtime) and no_offloaded_grad_on_device(runtime)
    assert runtime.step_state.phase is StepPhase.IDLE and worker_idle(runtime)
    # The next pass has its own retry, but the buffers are at their minimum already and every
    # other knob is the user's: nothing smaller to retry under, said at once.
    fault.times = 1
    with pytest.raises(OutOfMemoryRetryError, match="no smaller plan"):
        model(input_ids=ids, labels=ids).loss.backward()
    assert runtime.oom.retries == 1
    model(input_ids=ids, labels=ids).loss.backward()


def test_oom_in_backward_of_a_loss_computed_outside_the_model_is_not_retried():
    model = _copy(tiny_llama(), attach=True)
    runtime = rt.runtime_of(model)
    fault = OomFault(model.model.layers[1].mlp, "backward")
    ids = long_batches(1)[0]
    fault.times = 1
    logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), ids.view(-1))
    with pytest.raises(OutOfMemoryRetryError, match="outside the model"):
        loss.backward()
    assert runtime.oom.retries == 0
    assert offloaded_chunks_on_host(runtime) and no_offloaded_grad_on_device(runtime)


def test_oom_in_a_later_micro_batch_backward_is_not_retried_but_forward_is():
    """Gradient accumulation: the partial gradients of a failed second backward cannot be told
    apart from the first one's, so that is an error; a forward OOM there is retried."""
    base = tiny_llama()
    plain = train(copy.deepcopy(base), None, accum=2)
    attach = {"n_persist": 1, "activation_mode": "keep"}
    attached = train(copy.deepcopy(base), attach, "forward", fail_at=3, accum=2)
    assert_same_weights(plain["weights"], attached["weights"])
    assert attached["steps"] == STEPS
    with pytest.raises(OutOfMemoryRetryError, match="gradient accumulation"):
        train(copy.deepcopy(base), attach, "backward", fail_at=3, accum=2)


def test_an_oom_after_updates_in_the_backward_is_not_retried_but_a_longer_batchs_is():
    """A retry after early updates would update those chunks twice: the OOM is raised with the
    setting that keeps backward OOMs retryable. A batch longer than any trained runs its step
    without the update in the backward, so its OOM is retried and training matches plain."""
    model = _copy(tiny_llama(), attach=True)
    runtime = rt.runtime_of(model)
    fault = OomFault(model.model.layers[0].mlp, "backward")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = long_batches(1)[0][:, :16]
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert runtime.backward_update.on
    fault.times = 1
    with pytest.raises(OutOfMemoryRetryError, match="AUTOOFFLOAD_UPDATE_IN_BACKWARD=0"):
        model(input_ids=ids, labels=ids).loss.backward()
    assert runtime.oom.retries == 0
    with pytest.warns(UserWarning, match="include that part of a step"):
        autooffload.disable()

    base = tiny_llama()
    data = [ids[:, :16] for ids in long_batches(3)] + long_batches(2, seed=2)
    runs = []
    for attach in (False, True):
        model = _copy(base, attach)
        fault = OomFault(model.model.layers[0].mlp, "backward")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        for step, ids in enumerate(data):
            fault.times = 1 if attach and step == 3 else 0
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        runs.append(weights(model))
        if attach:
            assert rt.runtime_of(model).oom.retries == 1
            assert rt.runtime_of(model).backward_update.on
        autooffload.disable()
    assert_same_weights(*runs)


def test_disable_restores_the_model_forward():
    model = tiny_llama()
    assert "forward" not in model.__dict__
    enable_cpu(oom_retry=True)
    model.to("cpu")
    assert "forward" in model.__dict__
    import autooffload

    autooffload.disable()
    assert "forward" not in model.__dict__


def _generate(model: torch.nn.Module, prompt: torch.Tensor, cache: str) -> torch.Tensor:
    from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

    options: dict = {"cache_implementation": "static"} if cache == "static" else {}
    if cache == "sliding":
        sliding = DynamicCache()
        sliding.layers = [DynamicSlidingWindowLayer(sliding_window=64) for _ in model.model.layers]
        sliding.layer_class_to_replicate = None
        options["past_key_values"] = sliding
    return model.generate(prompt, max_new_tokens=4, do_sample=False, **options)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
@pytest.mark.parametrize("cache", ["dynamic", "static", "sliding"])
def test_an_oom_in_generate_rewinds_the_kv_cache_before_the_retry(cache: str):
    """A decoding forward extends the KV cache layer by layer: the failed pass left the first
    layers holding the new tokens, and the retry appended them a second time. A cache that
    cannot be rewound is not retried."""
    base = tiny_llama()
    prompt = long_batches(1, seed=3)[0][:, :6]
    runs = []
    for attach in (False, True):
        model = _copy(base, attach)
        fault = OomFault(model.model.layers[1].mlp, "forward")
        fault.times = 1 if attach else 0
        if attach and cache == "sliding":
            with pytest.raises(OutOfMemoryRetryError, match="KV cache .*cannot be rewound"):
                _generate(model, prompt, cache)
        tokens = _generate(model, prompt, cache)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        for ids in long_batches(2):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        runs.append((tokens, weights(model)))
        autooffload.disable()
    assert torch.equal(runs[1][0], runs[0][0])
    assert_same_weights(runs[0][1], runs[1][1])


def test_a_much_longer_batch_is_retried_as_a_profiling_step_and_planned_from_it():
    """The plan was searched on short batches; the OOM comes with a 4x longer one (more than
    ``REPROFILE_RATIO``): the retry runs the conservative profiling plan (persistent chunks
    kept, every block checkpointed) and profiles that step; the next step runs the plan searched
    from the long batch. Training matches plain PyTorch throughout."""
    base = tiny_llama()
    short = [ids[:, :16] for ids in long_batches(4)]
    data = [*short, *long_batches(2, seed=2)]
    runs = []
    for attach in (False, True):
        model = copy.deepcopy(base)
        runtime = None
        if attach:
            enable_cpu(oom_retry=True)
            model.to("cpu")
            runtime = rt.runtime_of(model)
        fault = OomFault(model.model.layers[1].mlp, "forward")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        plans = []
        for step, ids in enumerate(data):
            fault.times = 1 if attach and step == 4 else 0
            if runtime is not None and step == 4:
                before = runtime.plan
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if runtime is not None:
                plans.append(runtime.plan)
        runs.append(weights(model))
    assert_same_weights(*runs)
    assert runtime.oom.retries == 1
    retried, after = plans[4], plans[5]
    assert retried.source == REPROFILE_SOURCE and retried.n_persist == before.n_persist
    assert set(retried.block_policies) == {"checkpoint"}
    assert after.source == "search" and after.n_persist >= before.n_persist
    assert runtime.profile.batch_tokens == data[-1].numel()


def test_backward_of_a_scaled_loss_is_retried_with_the_same_scale():
    """``GradScaler.scale(loss)`` multiplies by a tensor; ``loss / accum`` divides by a number.
    A wrong scale on the retried backward would move the weights by a different step."""
    base = tiny_llama()
    scale = torch.tensor(8.0)
    ids = long_batches(1)[0]
    runs = []
    for attach in (False, True):
        model = _copy(base, attach)
        fault = OomFault(model.model.layers[1].mlp, "backward")
        fault.times = 1 if attach else 0
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        (scale * (model(input_ids=ids, labels=ids).loss / 2)).backward()
        optimizer.step()
        if attach:
            assert rt.runtime_of(model).oom.retries == 1
        runs.append(weights(model))
    assert_same_weights(*runs)
    moved = max((runs[0][k] - weights(base)[k]).abs().max().item() for k in runs[0])
    assert moved > 1e-2


def test_a_batch_that_outgrew_the_budget_is_replanned_under_that_budget_less_the_cut():
    """When the current plan's predicted peak for the failing batch is above the memory
    available, the scaled profile explains the OOM: the retry plans for the available memory
    less ``OOM_BUDGET_CUT``, not less the failed allocation too."""
    model = tiny_llama()
    enable_cpu(oom_retry=True)
    model.to("cpu")
    runtime = rt.runtime_of(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for ids in long_batches(4):
        ids = ids[:, :16]
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert runtime.plan.source == "search"
    guard = runtime.oom
    ratio = REPROFILE_RATIO * 0.75  # longer ones are profiled again
    guard.input_numel = int(ratio * guard.profiled_numel)
    hw = replace(hardware_profile(runtime), cuda_context_bytes=0)
    scaled = runtime.profile.with_batch_scaled(guard.input_numel / guard.profiled_numel)
    needed = make_plan(scaled, hw, runtime.plan.knobs, None).predicted_peak_bytes
    available = int(0.9 * needed)
    runtime.control.adopt_plan(replace(runtime.plan, budget_bytes=available))
    plan = shrunk_plan(runtime, requested_bytes=available // 2, batch_ratio=guard.batch_ratio)
    assert plan is not None
    assert plan.budget_bytes == available - int(OOM_BUDGET_CUT * available)
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert plan.n_persist == runtime.plan.n_persist


def test_a_checkpoint_cpu_plans_oom_is_measured_against_its_own_predicted_peak():
    """A plan keeping checkpointed blocks' inputs in host memory predicts a different peak than
    the same knobs with the inputs on the device (lower when the saved inputs outweigh the
    staging copies; higher on this 3-layer model). The OOM retry compares what is available
    with the plan's own prediction, so the budget it replans for follows from that one."""
    model = tiny_llama()
    enable_cpu(oom_retry=True, activation_mode="checkpoint_cpu")
    model.to("cpu")
    runtime = rt.runtime_of(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for ids in long_batches(4):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert "checkpoint_cpu" in runtime.plan.block_policies
    guard = runtime.oom
    guard.input_numel = guard.profiled_numel
    hw = replace(hardware_profile(runtime), cuda_context_bytes=0)
    knobs = runtime.plan.knobs
    on_device = make_plan(runtime.profile, hw, knobs, None).predicted_peak_bytes
    planned = profile_for_plan(runtime.profile, runtime.plan, hw)
    own = make_plan(planned, hw, knobs, None).predicted_peak_bytes
    assert own != on_device
    available = (own + on_device) // 2  # between the two predictions
    runtime.control.adopt_plan(replace(runtime.plan, budget_bytes=available))
    requested = 1
    if own > available:  # the batch outgrew what is available: plan for it less the cut
        expected = available - int(OOM_BUDGET_CUT * available)
    else:  # the plan was predicted to fit: plan for less than its prediction
        expected = own - max(requested, int(OOM_BUDGET_CUT * own))
    assert retry_budget(runtime, runtime.profile, requested) == expected


def test_a_retried_backward_plans_beside_what_the_failed_graph_still_holds(monkeypatch):
    """The failed backward's graph stays referenced by the script's loss through the retry, with
    the saved tensors of the nodes it had not reached: the retry's plan is searched for the
    budget less what is allocated beyond the forward's start once the runtime is cleaned up
    (8B LoRA at seq 49152 under 16 GiB: the retry ran out again with 15.56 GiB allocated)."""
    import autooffload.runtime.control.oom as oom_module

    model = tiny_llama()
    enable_cpu(oom_retry=True)
    model.to("cpu")
    runtime = rt.runtime_of(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    batches = long_batches(5)
    for ids in batches[:4]:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert runtime.plan.source == "search"
    guard = runtime.oom
    budget = int(runtime.plan.predicted_peak_bytes * 1.5)
    runtime.control.adopt_plan(replace(runtime.plan, budget_bytes=budget))
    held = int(0.05 * runtime.plan.predicted_peak_bytes)
    # The forward starts at 1 GiB allocated; after the clean-up the failed graph holds ``held``.
    readings = iter([1 << 30, (1 << 30) + held])
    monkeypatch.setattr(oom_module.OomRetry, "_allocated", lambda self: next(readings, 1 << 30))
    seen = []
    real = oom_module.shrunk_plan

    def spy(runtime_, requested, ratio, held_bytes=0):
        seen.append((retry_budget(runtime_, runtime_.profile, requested), held_bytes))
        return real(runtime_, requested, ratio, held_bytes)

    monkeypatch.setattr(oom_module, "shrunk_plan", spy)
    fault = OomFault(model.model.layers[1].mlp, "backward")
    fault.times = 1
    ids = batches[4]
    records = Records()
    logging.getLogger("autooffload").addHandler(records)
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        logging.getLogger("autooffload").removeHandler(records)
    assert guard.retries == 1
    ((without, passed),) = seen
    assert passed == held
    assert runtime.plan.budget_bytes == without - held
    words = f"the failed backward's graph holds {held / (1 << 20):.1f} MiB through the retry"
    assert any(words in line for line in records.lines)
