"""On a GPU: policies match plain autograd in bf16, and swap moves activations off the GPU."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from autooffload.runtime.activations.policies import ActivationSwapper, apply_policy
from autooffload.runtime.activations.tiled_mlp import tile_mlp

pytestmark = pytest.mark.gpu

# bf16 tolerance: swap and checkpoint replay the same kernels on the same data (bitwise in
# practice); tiling changes summation order, which in bf16 is worth a few ulps of the grads.
BF16_ATOL, BF16_RTOL = 2e-2, 2e-2


def llama(n_layers: int, hidden: int, dropout: float) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        attention_dropout=dropout,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).to("cuda", torch.bfloat16).train()


def step(model: LlamaForCausalLM, seq: int):
    model.zero_grad(set_to_none=True)
    ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(1)).cuda()
    embeds = model.model.embed_tokens(ids).detach().requires_grad_()
    torch.manual_seed(123)
    loss = model(inputs_embeds=embeds, labels=ids, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return loss.float().detach(), embeds.grad.float(), grads


@pytest.mark.parametrize(
    "policies",
    [
        ["checkpoint"] * 4,
        ["swap"] * 4,
        ["checkpoint_cpu"] * 4,
        ["swap", "checkpoint_cpu", "checkpoint", "keep"],
        "tiled",
    ],
)
def test_bf16_policies_match_plain_autograd(policies) -> None:
    model = llama(n_layers=4, hidden=256, dropout=0.1)
    expected = step(model, seq=512)
    swapper = ActivationSwapper("cuda", min_swap_bytes=1 << 16)
    for index, layer in enumerate(model.model.layers):
        if policies == "tiled":
            tile_mlp(layer.mlp, tile_tokens=128)
        else:
            apply_policy(layer, policies[index], swapper, block_index=index)
    actual = step(model, seq=512)
    torch.cuda.synchronize()
    for e, a in zip(
        (expected[0], expected[1], *expected[2].values()),
        (actual[0], actual[1], *actual[2].values()),
    ):
        torch.testing.assert_close(a, e, atol=BF16_ATOL, rtol=BF16_RTOL)
    if policies != "tiled" and "swap" in policies:
        assert swapper.stats()["d2h_bytes"] > 0


def peak_step_bytes(model: LlamaForCausalLM, seq: int) -> int:
    step(model, seq)  # grads allocated, pools warm: both runs measure the same steady state
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step(model, seq)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def block_activation_bytes(model: LlamaForCausalLM, seq: int) -> list[int]:
    """Per block: device memory its forward leaves allocated under keep (its activations)."""
    deltas = [0] * len(model.model.layers)
    handles = []
    for index, layer in enumerate(model.model.layers):

        def before(module, args, index=index):
            deltas[index] = -torch.cuda.memory_allocated()

        def after(module, args, output, index=index):
            deltas[index] += torch.cuda.memory_allocated()

        handles += [layer.register_forward_pre_hook(before), layer.register_forward_hook(after)]
    step(model, seq)
    for handle in handles:
        handle.remove()
    return deltas


def test_swap_lowers_peak_memory_by_the_swapped_bytes() -> None:
    n_layers, n_swap, seq = 10, 8, 4096
    model = llama(n_layers=n_layers, hidden=1024, dropout=0.0)
    keep_peak = peak_step_bytes(model, seq)
    activations = block_activation_bytes(model, seq)
    swapped_blocks = sum(activations[:n_swap])

    swapper = ActivationSwapper("cuda")
    for index, layer in enumerate(model.model.layers[:n_swap]):
        apply_policy(layer, "swap", swapper, block_index=index)
    for index, layer in enumerate(model.model.layers[:n_swap]):
        layer.register_full_backward_pre_hook(
            lambda module, grad, i=index: swapper.prefetch(i - 1) if i > 0 else None
        )
    swap_peak = peak_step_bytes(model, seq)
    assert swapper.stats()["d2h_bytes"] > 0
    # At the peak at most two swapped blocks are on the GPU: one whose D2H is in flight at the
    # end of forward, or one being used and one prefetched in backward.
    # Tensors under min_swap_bytes (norm statistics, small masks) stay on the GPU by design:
    # allow 2% of the swapped bytes for them (measured: ~0.6%).
    small_kept = 0.02 * swapped_blocks
    assert keep_peak - swap_peak >= swapped_blocks - 2 * max(activations[:n_swap]) - small_kept, (
        f"keep {keep_peak / 2**20:.0f} MiB, swap {swap_peak / 2**20:.0f} MiB, "
        f"swapped blocks' activations {swapped_blocks / 2**20:.0f} MiB"
    )
    # Pinned memory is allocated in the first swap step only.
    allocations = swapper.stats()["host_allocations"]
    step(model, seq)
    assert swapper.stats()["host_allocations"] == allocations


def test_the_last_swapped_blocks_tensors_go_when_the_next_block_is_done():
    """A swapped block's device tensors stay while its copy out runs beside the next block's
    forward, and go at that block's end, whatever its policy (the cost model's ``in_flight``).
    The last swapped block before checkpointed ones kept them to the backward: at 3.6B @ 16
    GiB ~0.6 GiB through twelve blocks and the loss, the allocated peak 9% over its
    prediction."""
    import autooffload
    from autooffload import runtime as rt

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16).train()
    autooffload.enable(
        force_attach=True, chunk_size=1 << 24, n_persist=0, n_swap=2, n_checkpoint=2, mask=False
    )
    try:
        model.to("cuda")
        runtime = rt.runtime_of(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, 256, (1, 2048), generator=torch.Generator().manual_seed(1)).cuda()
        in_flight = []
        for _ in range(4):  # two profiling steps, then the plan's
            loss = model(input_ids=ids, labels=ids).loss
            if runtime.activations.swapper is not None:
                in_flight.append(sorted(runtime.activations.swapper._in_flight))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert runtime.plan.block_policies == ("swap", "swap", "checkpoint", "checkpoint")
        assert runtime.activations.swapper.stats()["d2h_bytes"] > 0, "nothing was swapped"
        assert in_flight[-1] == [], in_flight
    finally:
        autooffload.disable()


def test_a_used_swap_copy_is_free_for_reuse_when_its_backward_is_done() -> None:
    """A swapped tensor brought back and used by the backward is freed in compute-stream order,
    like any tensor: held for the copy stream instead, its memory waited for every prefetch
    queued there after it (the next block's), and 8B LoRA at 32K tokens kept 3.4 GiB of used
    copies unusable at the peak, the allocator retrying at every block. A free the allocator
    completes at once is recorded as ``free_requested`` directly followed by ``free_completed``."""
    model = llama(n_layers=6, hidden=1024, dropout=0.0)
    swapper = ActivationSwapper("cuda")
    for index, layer in enumerate(model.model.layers):
        apply_policy(layer, "swap", swapper, block_index=index)
        layer.register_full_backward_pre_hook(
            lambda module, grad, i=index: swapper.prefetch(i - 1) if i > 0 else None
        )
    step(model, 2048)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=500_000, context="alloc", stacks="python")
    try:
        step(model, 2048)
        torch.cuda.synchronize()
        events = torch.cuda.memory._snapshot()["device_traces"][0]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    assert swapper.stats()["prefetched_tensors"] > 0
    copy_at: dict[int, bool] = {}  # address -> whether its live block is a swap copy
    freed, held = 0, []
    for index, event in enumerate(events):
        action, addr = event["action"], event.get("addr")
        if action == "alloc":
            copy_at[addr] = any(f.get("name") == "_bring_back" for f in event.get("frames", []))
        elif action == "free_requested" and copy_at.pop(addr, False):
            freed += 1
            after = events[index + 1] if index + 1 < len(events) else {}
            if after.get("action") != "free_completed" or after.get("addr") != addr:
                held.append(event.get("size"))
    assert freed > 0, "no swap copy was freed in the step"
    assert held == [], f"{len(held)} of {freed} used swap copies were held for the copy stream"


def test_a_big_swapped_tensor_round_trips_through_page_locked_memory() -> None:
    """A saved tensor of ``EXACT_PIN_BYTES`` or more leaves through a host buffer page-locked
    alone at its size class (not a power-of-two slab), copies asynchronously both ways and comes
    back equal; clearing the pool unlocks and frees it."""
    from autooffload.runtime.activations import swap

    swapper = ActivationSwapper("cuda")
    x = torch.randn(25_000_000, device="cuda", requires_grad=True)  # 100 MB of fp32
    nbytes = x.numel() * x.element_size()
    with swapper.saving(0):
        loss = (x * x.sin()).sum()
    swapper.prefetch(0)
    loss.backward()
    expected = x.detach().sin() + x.detach() * x.detach().cos()
    torch.testing.assert_close(x.grad, expected)
    assert swapper.stats()["d2h_bytes"] >= nbytes
    buffers = [buffer for idle in swapper.pool._idle.values() for buffer in idle]
    assert buffers and all(b.registered and b.data.is_pinned() for b in buffers)
    assert nbytes <= swapper.pool.allocated_bytes <= (1 + swap.SIZE_CLASS_ROUNDING) * 2 * nbytes
    del buffers
    swapper.pool.clear()
    assert swapper.pool.allocated_bytes == 0
