"""On a GPU: the profiled transients and the cost model count each gradient once, so the
predicted allocated peak of a planned step matches ``torch.cuda.max_memory_allocated``."""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import autooffload
from autooffload import runtime as rt

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("clean_gpu")]

# This test is about counting: each double count here is 40% of the peak or more (the head's
# gradient, its chunk counted as a chunk and in the post transient); on an H100 the prediction
# is +5.3% (64 MB on 1.19 GiB). The planner's 5% bar is for the benchmark workloads, on the
# reserved peak (tests/gpu/test_planner_gpu.py).
ALLOCATED_TOLERANCE = 0.10
VOCAB = 128256


def big_head_llama() -> LlamaForCausalLM:
    """Llama 3's vocabulary on a 2-layer hidden-2048 body: the untied head (263M params, its
    gradient 0.53 GB in bf16) is most of the model, as in Llama-3.2-3B's 3.6B untied variant."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=2048,
        intermediate_size=4096,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).to(torch.bfloat16).train()


def test_predicted_allocated_peak_counts_the_heads_gradient_once():
    model = big_head_llama()
    head_grad_bytes = model.lm_head.weight.numel() * 2
    # Everything offloaded: the peak is the post unit's backward (head chunk, logits, the loss's
    # temporaries and the head's gradient), where the gradient was once counted twice. CPU
    # updates only: the GPU update path's scratch, counted over the whole forward, would move
    # the predicted peak there and off the backward this test is about; and the optimizer state
    # of chunks the GPU updates in the backward (the head's, twice its gradient) would sit on
    # the post unit's backward beside it.
    autooffload.enable(
        force_attach=True, n_persist=0, mask=False, gpu_update_chunks=0, gpu_update_in_backward=0
    )
    model.to("cuda")
    assert rt.runtime_of(model) is not None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (1, 256), generator=generator).cuda() for _ in range(10)]

    def step(ids: torch.Tensor) -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    # Steps 1-2 profile, 3-7 run the plan, 7 may re-plan after calibrating; then measure.
    for ids in batches[:7]:
        step(ids)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for ids in batches[7:]:
        step(ids)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated()
    plan = autooffload.last_plan()
    assert plan is not None
    predicted = plan.breakdown["mem_allocated"]
    error = (predicted - measured) / measured
    numbers = (
        f"allocated peak predicted {predicted / 2**30:.3f} GiB vs measured"
        f" {measured / 2**30:.3f} GiB ({error:+.1%}); head gradient"
        f" {head_grad_bytes / 2**30:.3f} GiB\n{plan}\n{plan.breakdown}"
    )
    print(numbers)
    assert plan.breakdown["mem_peak_in_backward"], numbers
    assert abs(error) <= ALLOCATED_TOLERANCE, numbers


def _static_and_state_bytes(n_persist: int) -> tuple[int, int]:
    """The profile's static bytes with ``n_persist`` pinned, and the persistent Adam state's."""
    model = big_head_llama()
    autooffload.enable(force_attach=True, n_persist=n_persist, mask=False)
    model.to("cuda")
    runtime = rt.runtime_of(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (1, 128), generator=generator).cuda()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    persistent = [c for c in runtime.layout.chunks if c.index in runtime.manager.persistent]
    states = 4 * sum(s.numel for c in persistent for s in c.trainable_slots)  # bf16 m, v
    static = runtime.profile.static_bytes
    autooffload.disable()
    return static, states


def test_a_pinned_n_persist_profile_counts_the_persistent_states_once():
    """With AUTOOFFLOAD_N_PERSIST pinned the profiling steps run with persistent chunks, whose
    optimizer state (and gradients, before zero_grad) the measured step starts with. The cost
    model counts those apart, so the profile's static bytes must not hold them: it did, and
    3.6B with 15 pinned predicted 24 GiB for every plan and found none under 16."""
    pinned, states = _static_and_state_bytes(2)
    gc.collect()
    torch.cuda.empty_cache()
    unpinned, _ = _static_and_state_bytes(0)
    assert states > 100 << 20, "the test needs persistent state worth counting"
    assert abs(pinned - unpinned) < 0.25 * states, (pinned, unpinned, states)
