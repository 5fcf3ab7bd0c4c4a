"""On a GPU: frozen models attach and stream (``Settings.offload_frozen``). A DPO reference
model streams beside the attached policy, which trains like plain bf16; a frozen model larger
than the memory cap runs its forward and gives the uncapped model's logits."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn.functional as F
from test_offload_gpu import LOSS_ATOL, VOCAB, big_bf16_llama, tiny_bf16_llama

import autooffload
from autooffload import runtime as rt

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("clean_gpu")]

STEPS = 12
BETA = 0.1


def sequence_logps(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1].float()
    return -F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").sum(-1)


def dpo_run(base: torch.nn.Module, attach: bool) -> tuple[list[float], dict]:
    policy = copy.deepcopy(base)
    reference = copy.deepcopy(base).requires_grad_(False).eval()
    if attach:
        autooffload.enable(force_attach=True, chunk_size=1 << 20, mask=False)
    policy.to("cuda")
    reference.to("cuda")
    seen = {"policy": rt.runtime_of(policy) is not None, "reference": rt.runtime_of(reference)}
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-4, fused=True)
    generator = torch.Generator().manual_seed(1)
    # Two fixed batches of (chosen, rejected) pairs in turn: the margin grows, the loss falls.
    pool = [torch.randint(0, VOCAB, (4, 64), generator=generator).cuda() for _ in range(2)]
    losses = []
    for step in range(STEPS):
        ids = pool[step % 2]
        with torch.no_grad():
            ref = sequence_logps(reference, ids)
        if attach and step == 0:
            # Nothing of the reference stays on the device after its forward.
            runtime = seen["reference"]
            seen["resident_after_forward"] = [
                i
                for i, flat in enumerate(runtime.manager.gpu_flat)
                if flat.untyped_storage().nbytes()
            ]
        logps = sequence_logps(policy, ids)
        ratios = (logps - ref).view(2, 2)  # rows: (chosen, rejected) pairs
        loss = -F.logsigmoid(BETA * (ratios[:, 0] - ratios[:, 1])).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if attach:
        seen["reference_persistent"] = seen["reference"].plan.n_persist
        seen["reference"] = True
        autooffload.disable()
    else:
        seen["reference"] = seen["reference"] is not None
    return losses, seen


def test_a_frozen_reference_streams_and_dpo_trains_like_plain_bf16():
    base = tiny_bf16_llama()
    plain, plain_seen = dpo_run(base, attach=False)
    attached, seen = dpo_run(base, attach=True)
    assert plain_seen == {"policy": False, "reference": False}
    assert seen == {
        "policy": True,
        "reference": True,
        "resident_after_forward": [],
        "reference_persistent": 0,
    }
    assert plain[-1] < plain[0] - 0.05, plain
    torch.testing.assert_close(torch.tensor(attached), torch.tensor(plain), atol=LOSS_ATOL, rtol=0)


def test_a_frozen_model_over_the_cap_runs_attached_and_gives_the_uncapped_logits():
    ids = torch.randint(0, 32000, (2, 256), generator=torch.Generator().manual_seed(0)).cuda()
    model = big_bf16_llama("cpu").requires_grad_(False).eval()
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.to("cuda")
    with torch.no_grad():
        expected = model(input_ids=ids).logits.float()
    model.to("cpu")
    gc.collect()
    torch.cuda.empty_cache()
    cap = n_bytes * 3 // 4
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        autooffload.enable(budget=cap, mask=False)  # auto: 1.3 GB >= a quarter of the budget
        model.to("cuda")
        assert rt.runtime_of(model) is not None, "the frozen model was not attached"
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            actual = model(input_ids=ids).logits.float()
        peak = torch.cuda.max_memory_allocated()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert peak < cap, (peak, cap)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
