"""Activation policies give plain-autograd gradients, swap moves bytes, HF GC is taken over."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import LlamaConfig, LlamaForCausalLM

import autooffload
from autooffload import runtime as rt
from autooffload.errors import PlanError
from autooffload.runtime.activations.policies import (
    ActivationSwapper,
    apply_policy,
    hf_checkpointed_modules,
    is_kv_cache,
    is_recomputing,
    policy_of,
    remove_policy,
    restore_hf_gradient_checkpointing,
    take_over_hf_gradient_checkpointing,
)

SEQ = 16


def tiny_llama(n_layers: int = 3, attention_dropout: float = 0.2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=attention_dropout,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config).train()


def train_step(model: LlamaForCausalLM, autocast: bool = False, use_cache: bool = False):
    """Loss and gradients (of the input embeddings and of every parameter) of one step."""
    model.zero_grad(set_to_none=True)
    ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(1))
    embeds = model.model.embed_tokens(ids).detach().requires_grad_()
    torch.manual_seed(123)  # dropout draws the same masks in every run
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with amp:
        loss = model(inputs_embeds=embeds, labels=ids, use_cache=use_cache).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), embeds.grad.clone(), grads


def assert_same_step(expected, actual, atol: float = 1e-6, rtol: float = 1e-5) -> None:
    (loss_a, embeds_a, grads_a), (loss_b, embeds_b, grads_b) = expected, actual
    torch.testing.assert_close(loss_b, loss_a, atol=atol, rtol=rtol)
    torch.testing.assert_close(embeds_b, embeds_a, atol=atol, rtol=rtol)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], atol=atol, rtol=rtol, msg=name)


MIXES = {
    "keep": ["keep"] * 3,
    "checkpoint": ["checkpoint"] * 3,
    "swap": ["swap"] * 3,
    "checkpoint_cpu": ["checkpoint_cpu"] * 3,
    "mix": ["swap", "checkpoint_cpu", "checkpoint"],
}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast_bf16"])
@pytest.mark.parametrize("mix", list(MIXES))
def test_policies_match_plain_autograd(mix: str, autocast: bool) -> None:
    model = tiny_llama()
    expected = train_step(model, autocast)
    swapper = ActivationSwapper("cpu", min_swap_bytes=1024)
    for index, (layer, policy) in enumerate(zip(model.model.layers, MIXES[mix])):
        apply_policy(layer, policy, swapper, block_index=index)
    actual = train_step(model, autocast)
    assert_same_step(expected, actual)
    if "swap" in MIXES[mix] or "checkpoint_cpu" in MIXES[mix]:
        assert swapper.stats()["d2h_bytes"] > 0
        assert swapper.stats()["h2d_bytes"] == swapper.stats()["d2h_bytes"]


def test_dropout_is_active_so_rng_matters() -> None:
    model = tiny_llama()
    first = train_step(model)[0]
    torch.manual_seed(7)
    ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(1))
    assert not torch.equal(model(input_ids=ids, labels=ids).loss.detach(), first)


class TwoUses(nn.Module):
    """Saves its input twice (x * a and x * b) and a view of a parameter (via linear)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(dim))
        self.b = nn.Parameter(torch.randn(dim))
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x * self.a + x * self.b)


def test_swap_packs_dedupes_and_skips_parameters() -> None:
    torch.manual_seed(0)
    block = TwoUses(64)
    x = torch.randn(32, 64, requires_grad=True)
    (block(x).sum()).backward()
    expected = [x.grad.clone()] + [p.grad.clone() for p in block.parameters()]
    x.grad = None
    block.zero_grad(set_to_none=True)

    swapper = ActivationSwapper("cpu", min_swap_bytes=1024)
    apply_policy(block, "swap", swapper)
    (block(x).sum()).backward()
    actual = [x.grad] + [p.grad for p in block.parameters()]
    for e, a in zip(expected, actual):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    stats = swapper.stats()
    # x is saved by both muls (copied once, deduped once); the sum feeding proj is saved by
    # linear; a, b and proj.weight are parameters and stay where they are.
    assert stats["swapped_tensors"] == 2
    assert stats["deduped_tensors"] == 1
    assert stats["d2h_bytes"] == 2 * 32 * 64 * 4
    assert stats["kept_params"] == 3
    assert stats["h2d_bytes"] == stats["d2h_bytes"]


def test_pool_is_reused_across_steps() -> None:
    model = tiny_llama()
    swapper = ActivationSwapper("cpu", min_swap_bytes=1024)
    for index, layer in enumerate(model.model.layers):
        apply_policy(layer, "swap", swapper, block_index=index)
    train_step(model)
    after_first = swapper.stats()
    assert after_first["host_allocations"] > 0
    assert after_first["host_in_use_bytes"] == 0  # every buffer came back after backward
    for _ in range(2):
        train_step(model)
    after_third = swapper.stats()
    assert after_third["host_allocations"] == after_first["host_allocations"]
    assert after_third["host_allocated_bytes"] == after_first["host_allocated_bytes"]
    assert after_third["host_reuses"] >= 2 * after_first["swapped_tensors"]


def swapped_sizes(seq: int, blocks: int) -> list[int]:
    """A Llama-3-8B block's swapped tensors at ``seq`` tokens, bytes / 1024, in saving order:
    hidden states, K and V (grouped), MLP intermediates, a small one."""
    hidden, mlp = seq * 4096 * 2 >> 10, seq * 14336 * 2 >> 10
    return [hidden, hidden // 4, hidden // 4, hidden, hidden, mlp, mlp, mlp, 3000] * blocks


def test_pinned_buffers_are_carved_from_power_of_two_slabs(monkeypatch) -> None:
    """torch's pinned allocator rounds every allocation up to a power of two, so the pool pins
    power-of-two slabs and carves its buffers from them, first fit: at a sequence length whose
    tensors are no power of two the bytes pinned stay near the buffers' (one allocation each
    would pin 1.43x), ``allocated_bytes`` is what is pinned, buffers never overlap, a second
    step allocates nothing, and ``clear`` frees every slab none of whose buffers is in use.
    Scaled by 1/1024 (slabs of 1 MiB for 1 GiB)."""
    from autooffload.runtime.activations import swap

    pinned: list[int] = []
    empty = torch.empty

    def record(*size, dtype=None, pin_memory=False):
        if pin_memory:
            pinned.append(size[0])
        return empty(*size, dtype=dtype)  # no CUDA here: pageable, as big as asked

    monkeypatch.setattr(torch, "empty", record)
    monkeypatch.setattr(swap, "SLAB_BYTES", 1 << 20)
    pool = swap.HostBufferPool(pin_memory=True)
    sizes = swapped_sizes(24576, blocks=6)
    buffers = [pool.acquire(n) for n in sizes]
    assert pinned and all(n & (n - 1) == 0 for n in pinned), pinned
    assert pool.allocated_bytes == sum(pinned)
    carved = sum(b.size_class for b in buffers)
    one_each = sum(1 << (b.size_class - 1).bit_length() for b in buffers)
    assert carved <= pool.allocated_bytes <= 1.15 * carved and one_each > 1.4 * carved
    spans = sorted((b.data.data_ptr(), b.data.data_ptr() + b.size_class) for b in buffers)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    for buffer, n in zip(buffers, sizes):
        offset = buffer.data.data_ptr() - buffer.slab.data.data_ptr()
        assert buffer.data.numel() >= n and offset % 4096 == 0  # any dtype's alignment
    slabs = len(pinned)
    for buffer in buffers:
        pool.release(buffer)
    again = [pool.acquire(n) for n in sizes]
    assert len(pinned) == slabs
    assert pool.allocations == len(sizes) and pool.reuses == len(sizes)
    big = again[5]  # one MLP intermediate stays in use, alone in its slab
    for buffer in again:
        if buffer is not big:
            pool.release(buffer)
    pool.clear()
    assert pool.allocated_bytes == big.slab.data.numel() == 1 << 20
    # At a power-of-two length nothing is rounded: a slab per big buffer, nothing wasted; a few
    # small buffers pin a few KiB, not a slab.
    pinned.clear()
    exact = swap.HostBufferPool(pin_memory=True)
    buffers = [exact.acquire(n) for n in swapped_sizes(32768, blocks=6)]
    assert exact.allocated_bytes <= 1.08 * sum(b.size_class for b in buffers)
    small = swap.HostBufferPool(pin_memory=True)
    small.acquire(5000)
    assert small.allocated_bytes == 8192


def test_prefetch_brings_block_back_before_unpack() -> None:
    model = tiny_llama()
    swapper = ActivationSwapper("cpu", min_swap_bytes=1024)
    layers = model.model.layers
    for index, layer in enumerate(layers):
        apply_policy(layer, "swap", swapper, block_index=index)
    for index, layer in enumerate(layers):
        # What the runtime does: block i's pre-backward hook prefetches block i - 1.
        layer.register_full_backward_pre_hook(
            lambda module, grad, i=index: swapper.prefetch(i - 1) if i > 0 else None
        )
    expected_model = tiny_llama()
    assert_same_step(train_step(expected_model), train_step(model))
    stats = swapper.stats()
    # The last block (first in backward) is fetched on demand, and so are the rotary cos/sin
    # that block 0 swapped and later blocks deduped (block 2's backward needs them first).
    assert stats["on_demand_tensors"] > 0
    assert stats["prefetched_tensors"] + stats["on_demand_tensors"] == stats["swapped_tensors"]
    assert stats["prefetched_tensors"] > stats["on_demand_tensors"]


def test_remove_policy_restores_forward_exactly() -> None:
    model = tiny_llama()
    layer = model.model.layers[0]
    swapper = ActivationSwapper("cpu")
    for policy in ("checkpoint", "swap", "checkpoint_cpu"):
        apply_policy(layer, policy, swapper)
        assert policy_of(layer) == policy
        assert "forward" in layer.__dict__
        remove_policy(layer)
        assert "forward" not in layer.__dict__
        assert layer.forward.__func__ is type(layer).forward
        assert policy_of(layer) == "keep"
    custom = layer.forward
    layer.forward = custom  # an instance-level forward someone else installed
    apply_policy(layer, "checkpoint")
    remove_policy(layer)
    assert layer.__dict__["forward"] is custom


def test_invalid_policy_and_missing_swapper_are_errors() -> None:
    layer = tiny_llama().model.layers[0]
    with pytest.raises(PlanError, match="not one of"):
        apply_policy(layer, "offload")  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="needs an ActivationSwapper"):
        apply_policy(layer, "swap")


def count_recomputes(model: LlamaForCausalLM) -> list[int]:
    """Per layer: how often its MLP started inside a recompute.

    A pre-hook, because checkpoint's early stop ends a recompute at its last saved tensor, before
    the post-hooks of the modules that produced it run.
    """
    counts = [0] * len(model.model.layers)
    for index, layer in enumerate(model.model.layers):

        def hook(module, args, index=index):
            counts[index] += is_recomputing()

        layer.mlp.register_forward_pre_hook(hook)
    return counts


def hf_checkpointing_on(model: nn.Module) -> bool:
    """``model.is_activation_checkpointing`` (transformers >= 5.2x) without version checks."""
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def test_hf_gradient_checkpointing_is_taken_over_not_stacked() -> None:
    model = tiny_llama()
    expected = train_step(tiny_llama())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert hf_checkpointing_on(model)
    assert take_over_hf_gradient_checkpointing(model)
    assert not hf_checkpointing_on(model)
    assert set(hf_checkpointed_modules(model)) >= set(model.model.layers)
    started = []
    for layer in model.model.layers:
        apply_policy(layer, "checkpoint", on_recompute_start=started.append)
    counts = count_recomputes(model)
    assert_same_step(expected, train_step(model))
    assert counts == [1, 1, 1]
    assert started == list(reversed(model.model.layers))
    assert not is_recomputing()

    restore_hf_gradient_checkpointing(model)
    assert hf_checkpointing_on(model)
    assert not take_over_hf_gradient_checkpointing(tiny_llama())


def test_checkpoint_drops_kv_cache_in_training() -> None:
    model = tiny_llama()
    expected = train_step(tiny_llama())
    for layer in model.model.layers:
        apply_policy(layer, "checkpoint")
    assert_same_step(expected, train_step(model, use_cache=True))


def test_a_kv_cache_is_known_by_its_name_or_its_class() -> None:
    from transformers import DynamicCache

    cache = DynamicCache()
    for name in ("cache", "past_key_values", "past_key_value", "layer_past"):
        assert is_kv_cache(name, object()) and not is_kv_cache(name, None)
    assert is_kv_cache("kv_state", cache)  # a transformers Cache under a model's own name
    assert not is_kv_cache("attention_mask", torch.ones(2, 4))
    assert not is_kv_cache("use_cache", True)


class InnerCheckpoint(nn.Module):
    """A user block that checkpoints part of its own forward."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.dropout = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = lambda h: self.dropout(torch.nn.functional.gelu(self.up(h)))
        return x + self.down(checkpoint(inner, x.sin(), use_reentrant=False))


def run_inner(block: nn.Module, x: torch.Tensor, outer: contextlib.AbstractContextManager):
    block.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    torch.manual_seed(5)
    with outer:
        out = block(block(x))
    out.square().sum().backward()
    return [x.grad] + [p.grad for p in block.parameters()]


@pytest.mark.parametrize("outer", ["none", "save_on_cpu"])
def test_swap_composes_with_user_checkpoint_and_outer_hooks(outer: str) -> None:
    torch.manual_seed(0)
    block = InnerCheckpoint(32)
    x = torch.randn(8, 32)
    make_outer = lambda: (
        torch.autograd.graph.save_on_cpu() if outer == "save_on_cpu" else contextlib.nullcontext()
    )
    expected = run_inner(block, x, make_outer())
    swapper = ActivationSwapper("cpu", min_swap_bytes=0)
    apply_policy(block, "swap", swapper)
    actual = run_inner(block, x, make_outer())
    for e, a in zip(expected, actual):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    if outer == "none":
        assert swapper.stats()["swapped_tensors"] > 0
        assert swapper.stats()["nested_skips"] == 0
    else:
        assert swapper.stats()["swapped_tensors"] == 0
        assert swapper.stats()["nested_skips"] == 2


def test_no_grad_forward_is_untouched() -> None:
    model = tiny_llama().eval()
    ids = torch.randint(0, 128, (1, SEQ))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    swapper = ActivationSwapper("cpu", min_swap_bytes=0)
    for layer, policy in zip(model.model.layers, ["swap", "checkpoint", "checkpoint_cpu"]):
        apply_policy(layer, policy, swapper)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=0, atol=0)
    assert swapper.stats()["swapped_tensors"] == 0


class _NormedBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.linear(x)))


class _NormedNet(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_NormedBlock(width) for _ in range(3))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.parametrize("attach", ["checkpoint", "searched"])
def test_batch_norm_running_statistics_are_updated_once_per_forward(offload_cpu, attach) -> None:
    """A recomputed block, and the profiling probe re-running one, leave its batch norms'
    running mean, variance and batch count as the forward left them: they equal plain
    training's (a second update drew them towards the batch twice per step)."""
    torch.manual_seed(0)
    base = _NormedNet()

    def train(model: nn.Module) -> dict[str, torch.Tensor]:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(0)
        for _ in range(4):
            loss = model(torch.randn(8, 16, generator=generator)).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        autooffload.disable()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    plain = train(copy.deepcopy(base))
    offload_cpu(**({} if attach == "searched" else {"n_persist": 0, "activation_mode": attach}))
    model = copy.deepcopy(base).to("cpu")
    assert rt.runtime_of(model) is not None
    attached = train(model)
    assert plain["layers.0.norm.num_batches_tracked"].item() == 4
    for key, value in plain.items():
        torch.testing.assert_close(attached[key], value, rtol=1e-6, atol=1e-6, msg=key)


def test_big_pinned_buffers_are_page_locked_alone_at_their_size(monkeypatch) -> None:
    """At a length that is no power of two, power-of-two slabs pinned 1.2-1.3x a long batch's
    swapped bytes (Llama-3-8B at 49,152 tokens); buffers of ``EXACT_PIN_BYTES`` or more are
    page-locked alone, at most ``SIZE_CLASS_ROUNDING`` over their request, and unlocked when
    they go. Scaled by 1/1024, as the slab test."""
    from autooffload.runtime.activations import swap

    locked: list[int] = []
    unlocked: list[int] = []
    monkeypatch.setattr(swap, "EXACT_PIN_BYTES", 64 << 10)
    monkeypatch.setattr(swap, "_host_register", lambda data: locked.append(data.numel()))
    monkeypatch.setattr(swap, "_unlock_when_idle", lambda data: unlocked.append(data.numel()))
    monkeypatch.setattr(swap, "_check_host_room", lambda nbytes, held: None)
    empty = torch.empty
    monkeypatch.setattr(  # no CUDA here: a slab's pinned memory is pageable
        torch, "empty", lambda *size, dtype=None, pin_memory=False: empty(*size, dtype=dtype)
    )
    hidden = 49152 * 4096 * 2 >> 10
    # Per block: fp32 and bf16 hidden-sized tensors, grouped K and V, a small one.
    sizes = [2 * hidden, 2 * hidden, hidden, hidden, hidden // 4, hidden // 4, hidden, 3000] * 22
    pool = swap.HostBufferPool(pin_memory=True)
    buffers = [pool.acquire(n) for n in sizes]
    big = [n for n in sizes if n >= swap.EXACT_PIN_BYTES]
    assert len(locked) == len(big) and pool.allocated_bytes >= sum(sizes)
    assert pool.allocated_bytes <= (1 + swap.SIZE_CLASS_ROUNDING) * sum(big) + (1 << 20)
    for buffer in buffers:
        pool.release(buffer)
    again = [pool.acquire(n) for n in sizes]
    assert len(locked) == len(big), "a second step locks nothing new"
    del buffers
    for buffer in again:
        pool.release(buffer)
    del again, buffer
    pool.clear()
    assert sorted(unlocked) == sorted(locked) and pool.allocated_bytes == 0


def test_pinning_past_the_hosts_memory_is_a_clear_error(monkeypatch) -> None:
    """A new pinned buffer that would leave the host under ``HOST_FLOOR_BYTES`` available raises
    ``HostMemoryError`` naming the setting to lower, before the kernel's out-of-memory kill."""
    from autooffload.errors import HostMemoryError
    from autooffload.runtime.activations import swap
    from autooffload.runtime.chunks import host
    from autooffload.runtime.chunks.host import HostMemory

    available = [8 << 30]
    monkeypatch.setattr(
        host, "host_memory", lambda: HostMemory(64 << 30, available[0], cgroup_limited=False)
    )
    monkeypatch.setattr(swap, "_host_register", lambda data: None)
    monkeypatch.setattr(swap, "EXACT_PIN_BYTES", 64 << 10)
    empty = torch.empty
    monkeypatch.setattr(
        torch, "empty", lambda *size, dtype=None, pin_memory=False: empty(*size, dtype=dtype)
    )
    pool = swap.HostBufferPool(pin_memory=True)
    pool.acquire(1 << 20)  # 8 GiB available: fits
    available[0] = swap.HOST_FLOOR_BYTES + (1 << 20)
    with pytest.raises(HostMemoryError, match="AUTOOFFLOAD_N_SWAP"):
        pool.acquire(2 << 20)
    available[0] = swap.HOST_FLOOR_BYTES
    with pytest.raises(HostMemoryError, match="AUTOOFFLOAD_N_SWAP"):
        pool.acquire(16 << 10)  # a slab's too


def test_shorter_batches_reuse_a_longer_ones_host_buffers() -> None:
    """Batches of varied lengths (SFT without packing): a step shorter than an earlier one takes
    that step's idle buffers (up to twice its size class) instead of pinning its own, so after
    the longest step the pool stops growing; a step of one shape reuses its own classes."""
    from autooffload.runtime.activations import swap

    pool = swap.HostBufferPool(pin_memory=False)

    def step(seq: int) -> None:
        buffers = [pool.acquire(n) for n in swapped_sizes(seq, blocks=4)]
        for buffer in buffers:
            pool.release(buffer)

    step(8192)
    held = pool.allocated_bytes
    allocations = pool.allocations
    for seq in (7168, 5120, 6144, 4608, 8192, 7680):
        step(seq)
    assert pool.allocations == allocations and pool.allocated_bytes == held
    assert pool.in_use_bytes == 0
