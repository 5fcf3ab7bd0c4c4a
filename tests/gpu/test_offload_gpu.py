"""On a GPU: bf16 training attached equals plain bf16 training, a model too big for the memory
cap trains, and ``disable()`` leaves no pinned memory or threads behind."""

from __future__ import annotations

import copy
import gc
import math
import threading
from collections.abc import Callable

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import autooffload
from autooffload import runtime as rt

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("clean_gpu")]

STEPS = 20
VOCAB = 512
# bf16 keeps 8 bits of mantissa (relative spacing 2**-8 = 0.4%). The attached run updates
# offloaded params with the fused CPU AdamW and persistent ones with the fused CUDA AdamW; both
# compute in fp32 and round to bf16, but they may round the last bit differently, and while the
# model memorises its two batches such 1-ulp differences feed back through the weights. On an
# H100 (torch 2.11) the losses, which fall from 6.3 to 3.8 over the 20 steps, differed by at most
# 1.4e-2 with every chunk offloaded and 4e-3 with 3 of 6 persistent; the final losses by 0.4%.
# A stale chunk, a skipped update or a lost gradient moves them by 0.1 or more.
LOSS_ATOL = 5e-2
FINAL_LOSS_RTOL = 1e-2
# fp32 masters round differently from a bf16-only run by design (they keep the sub-ulp part of
# every update): measured max 4.8e-2 per step and 0.13% at the end, so a looser bound.
MASTER_LOSS_ATOL = 1e-1
MASTER_FINAL_LOSS_RTOL = 2e-2


def tiny_bf16_llama(tied: bool = True) -> LlamaForCausalLM:
    """4 layers, hidden 256: the lead's reference model for the bf16 comparison."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config).to(torch.bfloat16).train()


def train_bf16(
    model: LlamaForCausalLM,
    attach: dict | None,
    steps: int = STEPS,
    clip: bool = True,
    after_backward: Callable[[], None] | None = None,
) -> list[float]:
    if attach is not None:
        autooffload.enable(force_attach=True, chunk_size=1 << 20, mask=False, **attach)
    model.to("cuda")
    assert (rt.runtime_of(model) is not None) == (attach is not None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    # Two fixed batches in turn: random tokens cannot be learned, memorised ones can, so the
    # loss falls and a run that stops updating some weights shows up in it.
    generator = torch.Generator().manual_seed(1)
    pool = [torch.randint(0, VOCAB, (2, 64), generator=generator).cuda() for _ in range(2)]
    losses = []
    for step in range(steps):
        ids = pool[step % len(pool)]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if after_backward is not None:
            after_backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if attach is not None:
        autooffload.disable()
    return losses


@pytest.mark.parametrize("n_persist", [0, 3])
def test_bf16_training_matches_plain_bf16(n_persist):
    base = tiny_bf16_llama()
    plain = train_bf16(copy.deepcopy(base), attach=None)
    offloaded = train_bf16(
        copy.deepcopy(base), attach={"n_persist": n_persist, "master_weights": False}
    )
    assert plain[-1] < plain[0] - 0.5, "the reference did not learn; the comparison is moot"
    torch.testing.assert_close(torch.tensor(offloaded), torch.tensor(plain), atol=LOSS_ATOL, rtol=0)
    assert math.isclose(offloaded[-1], plain[-1], rel_tol=FINAL_LOSS_RTOL)


def test_the_update_in_the_backward_trains_like_plain_bf16():
    """No clipping, so the update in the backward applies: offloaded chunks updated on the CPU
    as their gradients arrive, persistent ones stepped by the user's fused CUDA AdamW on the
    autograd thread as their backward ends, their gradients dropped (none left at step())."""
    base = tiny_bf16_llama()
    plain = train_bf16(copy.deepcopy(base), attach=None, clip=False)
    stepped = []

    def check() -> None:
        runtime = rt.runtimes()[0]
        persistent = [runtime.layout.chunks[i] for i in sorted(runtime.manager.persistent)]
        grads = [s.param.grad for c in persistent for s in c.trainable_slots]
        stepped.append((sorted(runtime.cpu_optim.early.persistent), all(g is None for g in grads)))

    attach = {"n_persist": 3, "master_weights": False, "update_in_backward": True}
    offloaded = train_bf16(copy.deepcopy(base), attach=attach, clip=False, after_backward=check)
    assert plain[-1] < plain[0] - 0.5, "the reference did not learn; the comparison is moot"
    torch.testing.assert_close(torch.tensor(offloaded), torch.tensor(plain), atol=LOSS_ATOL, rtol=0)
    assert math.isclose(offloaded[-1], plain[-1], rel_tol=FINAL_LOSS_RTOL)
    # Armed from the second step on: every persistent chunk stepped, no gradient left.
    assert stepped[0] == ([], False)
    assert all(s == ([0, 1, 2], True) for s in stepped[1:]), stepped


def test_chunks_updated_on_the_gpu_in_the_backward_train_like_plain_bf16(resident_updates):
    """The update in the backward with the lowest three offloaded chunks on the GPU: their
    state copied in one group ahead on the in stream, torch's fused AdamW on the out stream
    over their resident weights and gradients, weights and state back to pinned memory, the
    next forward's gathers waiting for them; the rest on the CPU as their gradients arrive."""
    base = tiny_bf16_llama()
    plain = train_bf16(copy.deepcopy(base), attach=None, clip=False)
    attach = {
        "n_persist": 1,
        "master_weights": False,
        "update_in_backward": True,
        "gpu_update_in_backward": 3,
    }
    offloaded = train_bf16(copy.deepcopy(base), attach=attach, clip=False)
    assert sorted(set(resident_updates)) == [1, 2, 3], resident_updates
    assert len(resident_updates) >= 3 * (STEPS - 2), resident_updates
    torch.testing.assert_close(torch.tensor(offloaded), torch.tensor(plain), atol=LOSS_ATOL, rtol=0)
    assert math.isclose(offloaded[-1], plain[-1], rel_tol=FINAL_LOSS_RTOL)


def test_gpu_updated_chunks_train_like_plain_bf16(gpu_updates):
    """The GPU update path on CUDA: state streamed through the copy streams, torch's fused
    AdamW on the scratch sets, weights and state back, clipping applied on the device."""
    updated = gpu_updates
    base = tiny_bf16_llama()
    plain = train_bf16(copy.deepcopy(base), attach=None)
    offloaded = train_bf16(
        copy.deepcopy(base),
        attach={"n_persist": 0, "master_weights": False, "gpu_update_chunks": 3},
    )
    assert len(set(updated)) == 3 and len(updated) >= 3 * (STEPS - 2), updated
    torch.testing.assert_close(torch.tensor(offloaded), torch.tensor(plain), atol=LOSS_ATOL, rtol=0)
    assert math.isclose(offloaded[-1], plain[-1], rel_tol=FINAL_LOSS_RTOL)


def test_bf16_training_with_fp32_masters_follows_plain_bf16():
    base = tiny_bf16_llama()
    plain = train_bf16(copy.deepcopy(base), attach=None)
    offloaded = train_bf16(copy.deepcopy(base), attach={"n_persist": 1, "master_weights": True})
    torch.testing.assert_close(
        torch.tensor(offloaded), torch.tensor(plain), atol=MASTER_LOSS_ATOL, rtol=0
    )
    assert math.isclose(offloaded[-1], plain[-1], rel_tol=MASTER_FINAL_LOSS_RTOL)


@pytest.mark.parametrize("scratch", [None, 64 << 10], ids=["whole", "pieces"])
@pytest.mark.parametrize("clip", [False, True], ids=["noclip", "clip"])
def test_accumulation_summed_on_the_gpu_trains_like_plain_bf16(monkeypatch, clip, scratch):
    """``accumulate_on=gpu``: the running sums in pinned staging come back through the scratch
    (whole, or in 64 KiB pieces), are added on a side stream and go out in place of the
    gradients; clipping reads the norms of the sums taken on the device. Plain torch sums
    ``.grad`` in bf16 the same way (one rounding per add), so the bound is the bf16 one."""
    from autooffload.runtime.chunks import grad_offload

    if scratch is not None:
        monkeypatch.setattr(grad_offload, "SUM_SCRATCH_BYTES", scratch)
    base = tiny_bf16_llama()
    micro, steps = 3, 10
    generator = torch.Generator().manual_seed(1)
    pool = [torch.randint(0, VOCAB, (2, 64), generator=generator).cuda() for _ in range(4)]

    def run(attach: dict | None) -> tuple[list[float], dict]:
        model = copy.deepcopy(base)
        if attach is not None:
            autooffload.enable(force_attach=True, chunk_size=1 << 20, mask=False, **attach)
        model.to("cuda")
        runtime = rt.runtime_of(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
        losses = []
        for step in range(steps):
            for m in range(micro):
                ids = pool[(step * micro + m) % len(pool)]
                loss = model(input_ids=ids, labels=ids).loss / micro
                loss.backward()
                losses.append(loss.item())
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
        stats = {}
        if runtime is not None:
            stats = {**runtime.manager.stats, "added": runtime.cpu_optim.staging.added_params}
            autooffload.disable()
        return losses, stats

    plain, _ = run(None)
    summed, stats = run({"n_persist": 1, "master_weights": False, "accumulate_on": "gpu"})
    assert stats["added"] == 0 and stats["summed_params"] > 0
    assert stats["sum_h2d_bytes"] == 2 * stats["summed_params"]
    assert plain[-1] < plain[0] - 0.3, "the reference did not learn; the comparison is moot"
    torch.testing.assert_close(torch.tensor(summed), torch.tensor(plain), atol=LOSS_ATOL, rtol=0)
    assert math.isclose(summed[-1], plain[-1], rel_tol=FINAL_LOSS_RTOL)


# ---- a model larger than the memory cap ----------------------------------------------------------

CAP_BYTES = 3 << 30


def big_config() -> LlamaConfig:
    """~0.66B params, 1.3 GB in bf16: full FT needs ~5.3 GB (8 B/param) before activations."""
    return LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )


def big_bf16_llama(device: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return LlamaForCausalLM(big_config())
    finally:
        torch.set_default_dtype(default_dtype)


def full_ft_steps(model: LlamaForCausalLM, steps: int) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 32000, (1, 256), generator=torch.Generator().manual_seed(0)).cuda()
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture
def memory_cap():
    """Cap this process at CAP_BYTES of the GPU, as a smaller GPU would."""
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(CAP_BYTES / total)
    yield CAP_BYTES
    torch.cuda.set_per_process_memory_fraction(1.0)


def test_model_that_does_not_fit_under_the_cap_trains_when_attached(memory_cap):
    vanilla = big_bf16_llama("cuda")
    with pytest.raises(torch.OutOfMemoryError):
        full_ft_steps(vanilla, steps=1)
    del vanilla
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()

    model = big_bf16_llama("cpu")
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert 4 * n_bytes > memory_cap, "vanilla full FT of this model would fit under the cap"
    autooffload.enable(budget=memory_cap, mask=False)
    model.to("cuda")
    assert rt.runtime_of(model) is not None, "a 1.3 GB model was not attached (threshold 1 GiB)"
    losses = full_ft_steps(model, steps=3)
    assert all(math.isfinite(loss) for loss in losses), losses
    assert torch.cuda.max_memory_allocated() <= memory_cap


# ---- teardown ---------------------------------------------------------------------------------


def _pinned_pool_bytes() -> int:
    """Bytes the pinned host allocator holds (in use or cached for reuse)."""
    torch.cuda.synchronize()
    return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)


def _autooffload_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("autooffload")]


def _attach_and_train(steps: int = 3) -> LlamaForCausalLM:
    model = tiny_bf16_llama(tied=False)
    autooffload.enable(force_attach=True, chunk_size=1 << 20, n_persist=1, mask=False)
    model.to("cuda")
    runtime = rt.runtime_of(model)
    assert runtime is not None and runtime.manager.host.pinned
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert _autooffload_threads(), "the CPU optimizer never started its worker"
    return model


def test_disable_leaves_no_pinned_memory_or_threads():
    """The pinned allocator caches freed blocks instead of returning them to CUDA, so a leak
    shows as growth: a second attach/train/disable of the same model must reuse the blocks the
    first one freed, and would need new ones if anything still held the first arena."""
    threads_before = _autooffload_threads()
    first = _attach_and_train()
    assert _pinned_pool_bytes() > 0
    autooffload.disable()
    del first
    gc.collect()
    assert _autooffload_threads() == threads_before, "the CPU optimizer thread outlived disable()"
    pool_after_first = _pinned_pool_bytes()

    second = _attach_and_train()
    autooffload.disable()
    assert _pinned_pool_bytes() == pool_after_first, "pinned host memory outlived disable()"
    assert _autooffload_threads() == threads_before
    assert all(p.is_cuda and not p.is_pinned() for p in second.parameters())
    ids = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    assert second(input_ids=ids, labels=ids).loss.isfinite()


# ---- allocator pools ----------------------------------------------------------------------


@pytest.mark.parametrize("pool", ["compute", "copy"])
def test_streamed_chunks_come_from_the_chosen_streams_pool(pool):
    """By default chunk storage comes from the compute stream's pool, never from the copy
    stream's: memory freed in one stream's pool cannot serve the other until the cache is
    emptied, so two pools would hold the sum of their peaks and, under a cap, force an
    empty-and-synchronise retry. ``chunk_pool="copy"`` keeps the older behaviour."""
    model = tiny_bf16_llama(tied=False)
    autooffload.enable(
        force_attach=True, chunk_size=1 << 20, n_persist=0, mask=False, chunk_pool=pool
    )
    model.to("cuda")
    runtime = rt.runtime_of(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    torch.cuda.empty_cache()
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.cuda.synchronize()
    assert runtime.manager.stats["h2d_bytes"] > 0, "nothing was streamed: the check is moot"
    copy_stream = runtime.manager.h2d_stream.cuda_stream
    segments = torch.cuda.memory_snapshot()
    assert segments, "the allocator reported no segment"
    on_copy_stream = sum(s["total_size"] for s in segments if s["stream"] == copy_stream)
    if pool == "compute":
        assert on_copy_stream == 0, f"{on_copy_stream} bytes reserved in the copy stream's pool"
    else:
        largest = max(chunk.nbytes for chunk in runtime.layout.chunks)
        assert on_copy_stream >= largest, "chunks did not come from the copy stream's pool"
