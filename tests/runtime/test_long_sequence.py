"""The planned long-sequence path: tiled MLPs chosen by the search, the chunked loss and
checkpointed blocks with host-kept inputs train like plain autograd; untiled plans install
nothing."""

from __future__ import annotations

import copy
import functools
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers.models.mixtral.configuration_mixtral import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

import autooffload
from autooffload import runtime as rt
from autooffload.errors import PlanError
from autooffload.plan import search as plan_search
from autooffload.runtime import runtime as runtime_module
from autooffload.runtime.activations import model_activations
from autooffload.runtime.activations.policies import policy_of
from autooffload.runtime.activations.tiled_mlp import (
    find_mlp,
    find_norms,
    is_tiled,
    set_mlp_tiles,
)
from autooffload.runtime.control import planning
from tests.runtime.runtime_models import BATCH, SEQ, enable_cpu
from tests.runtime.test_offload_equivalence import ATOL, RTOL, adamw, assert_same_training, train

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 6
TILE = BATCH * SEQ // 4  # four tiles per batch


def decoder_mlps(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [layer.mlp for layer in model.model.layers]


def profiled_budget(model: torch.nn.Module, data: list[torch.Tensor]) -> int:
    """A budget between the smallest peak of the tiled plans and that of the untiled ones, from
    the profile of one attached step (byte figures on the CPU simulation are deterministic)."""
    probe = copy.deepcopy(model)
    enable_cpu(checkpoint_inputs="cpu")
    probe.to("cpu")
    optimizer = adamw(probe.parameters())
    for ids in data[:3]:  # through the profiling steps to the searched plan
        probe(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    request = rt.runtime_of(probe).search_request
    untiled = replace(request, mlp_tiles=()).candidates().peak_bytes.min()
    tiled = replace(request, mlp_tiles=(TILE,)).candidates().peak_bytes.min()
    autooffload.disable()
    assert tiled < untiled
    return int((tiled + untiled) // 2)


def test_planned_long_sequence_path_trains_like_plain_autograd(
    make_llama, make_batches, offload_cpu, monkeypatch
) -> None:
    monkeypatch.setattr(plan_search, "MLP_TILE_TOKENS", (TILE,))
    base = make_llama(tied=False)
    data = make_batches(STEPS)
    budget = profiled_budget(base, data)
    seen = []

    def check(runtime) -> None:
        seen.append(runtime.plan)
        assert all(is_tiled(mlp) for mlp in decoder_mlps(runtime.model))
        # The norms are tiled with the MLPs.
        norms = [n for layer in runtime.model.model.layers for n in find_norms(layer)]
        assert len(norms) == 2 * len(runtime.model.model.layers)
        assert all(is_tiled(norm) for norm in norms)

    plain = train(copy.deepcopy(base), data, attach=None, offload_cpu=offload_cpu)
    model = copy.deepcopy(base)
    planned = train(
        model,
        data,
        attach={"budget": budget, "checkpoint_inputs": "cpu", "chunked_loss": True},
        offload_cpu=offload_cpu,
        before_detach=check,
    )
    (plan,) = seen
    assert plan.mlp_tile_tokens == TILE
    assert plan.predicted_peak_bytes <= budget
    assert "checkpoint_cpu" in plan.block_policies
    # Tiles sum the MLP's weight gradients in another order and the chunked loss its rows:
    # ~1e-7 relative per step, within the equivalence tests' 1e-5 over a few AdamW steps.
    assert (RTOL, ATOL) == (1e-5, 1e-5)
    assert_same_training(plain, planned)
    assert not any(is_tiled(mlp) for mlp in decoder_mlps(model))  # detach untiles


def test_the_final_norm_is_tiled_from_attach_and_trains_like_plain(
    make_llama, make_batches, offload_cpu, monkeypatch
) -> None:
    """A batch of more tokens than ``FINAL_NORM_TILE_TOKENS`` runs the causal LM's final norm
    in tiles, whatever the plan: it saves its input alone (one hidden state; an untiled norm
    saves two or more, a bf16 RMSNorm an fp32 copy among them), and training matches plain
    autograd; detach untiles it."""
    monkeypatch.setattr(model_activations, "FINAL_NORM_TILE_TOKENS", TILE)
    base = make_llama(tied=False)
    data = make_batches(STEPS)
    saved: dict[str, list[torch.Tensor]] = {}

    def norm_saves(model: torch.nn.Module, key: str) -> None:
        """What the final norm saves for the backward in one training forward."""
        tensors: list[torch.Tensor] = []
        entered = []
        norm = model.model.norm

        def pack(t: torch.Tensor) -> torch.Tensor:
            if entered:
                tensors.append(t)
            return t

        pre = norm.register_forward_pre_hook(lambda m, a: entered.append(True))
        post = norm.register_forward_hook(lambda m, a, o: entered.clear())
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=data[0], labels=data[0]).loss.backward()
        pre.remove()
        post.remove()
        model.zero_grad(set_to_none=True)
        saved[key] = tensors

    def check(runtime) -> None:
        assert is_tiled(runtime.model.model.norm)
        norm_saves(runtime.model, "tiled")

    plain_model = copy.deepcopy(base)
    plain = train(plain_model, data, attach=None, offload_cpu=offload_cpu)
    norm_saves(plain_model, "plain")
    model = copy.deepcopy(base)
    tiled = train(model, data, attach={}, offload_cpu=offload_cpu, before_detach=check)
    assert_same_training(plain, tiled)
    assert not is_tiled(model.model.norm)  # detach untiles
    hidden = data[0].numel() * model.config.hidden_size
    (kept,) = [t for t in saved["tiled"] if t.numel() >= hidden]
    assert kept.dtype == torch.float32 and kept.shape == (*data[0].shape, model.config.hidden_size)
    # Untiled: the fp32 input it squares and scales, and its normalised output for the weight.
    assert sum(t.numel() >= hidden for t in saved["plain"]) >= 2


def test_untiled_plan_installs_nothing(make_llama, make_batches, offload_cpu) -> None:
    model = make_llama()
    seen = []

    def check(runtime) -> None:
        seen.append(runtime.plan.mlp_tile_tokens)
        for mlp in decoder_mlps(runtime.model):
            assert not is_tiled(mlp) and "forward" not in mlp.__dict__

    train(model, make_batches(2), attach={}, offload_cpu=offload_cpu, before_detach=check)
    assert seen == [0]


def test_find_mlp_takes_token_wise_mlps_and_skips_routed_ones(make_llama) -> None:
    model = make_llama()
    layers = list(model.model.layers)
    assert [find_mlp(layer) for layer in layers] == decoder_mlps(model)
    assert set_mlp_tiles(layers, 8) == len(layers)
    assert set_mlp_tiles(layers, 0) == 0
    assert not any("forward" in mlp.__dict__ for mlp in decoder_mlps(model))
    config = MixtralConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=2,
    )
    moe = MixtralDecoderLayer(config, 0)
    assert find_mlp(moe) is None
    assert set_mlp_tiles([moe], 8) == 0


def test_a_batch_is_long_by_its_blocks_inputs_or_by_one_blocks_forward() -> None:
    """Llama-3-8B's block input at 524288 tokens is 4 GiB: 32 blocks' inputs pass a quarter of
    78 GiB, and so does one block's untiled forward where the model has only two blocks (its
    MLP's fp32 input copy alone is 28 GiB); at 16384 tokens neither does."""
    gib = 1 << 30
    budget = 78 * gib
    long_batch = model_activations.long_batch
    assert long_batch(32, 4 * gib, budget)
    assert long_batch(2, 4 * gib, budget)
    assert not long_batch(2, gib // 8, budget)
    assert not long_batch(32, gib // 8, budget)
    assert long_batch(32, gib // 2, 16 * gib)  # 8B at 65536 under 16 GiB, by its inputs
    assert not long_batch(2, 4 * gib, None)  # no budget: nothing to fit


@pytest.mark.parametrize(
    ("share", "host_room"),
    [(1e-9, None), (1e-9, 0), (1e-9, "two"), (None, None)],
    ids=["inputs-over-share", "no-host-room", "room-for-two", "default-share"],
)
def test_profiling_steps_fit_a_long_batch(
    make_llama, make_batches, offload_cpu, monkeypatch, share, host_room
) -> None:
    """When one input per checkpointed block would take more than a share of the budget, the
    profiling steps run every block as ``checkpoint_cpu`` (the first block's call already in
    flight included) with its MLP tiled, and train as plain autograd; where the host has no
    room for the inputs they stay on the device (``checkpoint``), the MLPs tiled; under the
    share they stay ``checkpoint``, untiled."""
    monkeypatch.setattr(model_activations, "PROFILING_MLP_TILE_TOKENS", TILE)
    if share is not None:
        monkeypatch.setattr(model_activations, "PROFILING_INPUTS_SHARE", share)
    if host_room is not None:
        # "two": room for two of the three blocks' inputs (2 x batch x seq x hidden x fp32).
        room = 2 * BATCH * SEQ * 32 * 4 if host_room == "two" else host_room
        monkeypatch.setattr(
            runtime_module, "host_room_for_activations", lambda held, local_ranks: room
        )
    base = make_llama(tied=False)
    data = make_batches(STEPS)
    seen: list[list[str]] = []

    def record(runtime) -> None:
        blocks = [g.module for g in runtime.groups if g.is_block]
        handles = []

        def hook(module, args):
            if runtime.control.profiling and torch.is_grad_enabled():
                seen.append([policy_of(b) for b in blocks])
                seen[-1] += ["tiled" if is_tiled(find_mlp(b)) else "untiled" for b in blocks]

        # The last block: the block probe runs the first one alone, its policy lifted.
        handles.append(blocks[-1].register_forward_hook(lambda m, a, o: hook(m, a)))
        return handles

    plain = train(copy.deepcopy(base), data, attach=None, offload_cpu=offload_cpu)
    model = copy.deepcopy(base)
    handles: list = []

    def hook_first_step(micro: int) -> None:
        if not handles:
            handles.extend(record(rt.runtime_of(model)))

    run = train(
        model,
        data,
        attach={"budget": "1GiB", "checkpoint_inputs": "cpu"},
        offload_cpu=offload_cpu,
        before_micro=hook_first_step,
        before_detach=lambda runtime: [handle.remove() for handle in handles],
    )
    cpu, gpu = "checkpoint_cpu", "checkpoint"
    expected = {
        "inputs-over-share": [cpu, cpu, cpu, "tiled", "tiled", "tiled"],
        "no-host-room": [gpu, gpu, gpu, "tiled", "tiled", "tiled"],
        "room-for-two": [cpu, cpu, gpu, "tiled", "tiled", "tiled"],
        "default-share": [gpu, gpu, gpu, "untiled", "untiled", "untiled"],
    }[
        "default-share"
        if share is None
        else {None: "inputs-over-share", 0: "no-host-room", "two": "room-for-two"}[host_room]
    ]
    assert seen and all(step == expected for step in seen), seen
    torch.testing.assert_close(
        torch.tensor(run.losses), torch.tensor(plain.losses), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("chosen", ["auto", "cpu"])
def test_the_search_puts_on_the_host_only_the_inputs_it_has_room_for(monkeypatch, chosen) -> None:
    """Room for every block's input: the choice stands. Room for some: ``auto`` lets the host
    keep the first blocks' inputs (as many as fit), ``cpu`` is an error naming the setting.
    Room for none: ``auto`` searches the device alone."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "plan"))
    from plan_profiles import make_profile

    profile = make_profile(n_blocks=4)
    one = profile.blocks[0].act_bytes_checkpoint
    assert one > 0 and all(u.act_bytes_checkpoint == one for u in profile.blocks)
    runtime = SimpleNamespace(
        settings=autooffload.Settings.from_env(checkpoint_inputs=chosen),
        device=torch.device("cuda"),
        activations=SimpleNamespace(swapper=None),
        local_ranks=1,
    )

    def where(room: int):
        return planning._inputs_where_they_fit(runtime, profile, room)

    assert where(4 * one) == (chosen, None)
    if chosen == "auto":
        assert where(3 * one - 1) == ("auto", 2)
        assert where(one - 1) == ("gpu", None)
    else:
        with pytest.raises(PlanError, match="checkpoint_inputs=cpu.*AUTOOFFLOAD_CHECKPOINT_INPUTS"):
            where(4 * one - 1)


@pytest.mark.parametrize("room", ["all", "none"])
def test_swapped_blocks_are_planned_within_the_hosts_room(
    make_llama, make_batches, offload_cpu, monkeypatch, room
) -> None:
    """Swapped blocks' saved tensors live in host memory: with room for all of them the plan
    swaps every block (``activation_mode=swap``), says how much the host holds and trains like
    plain; with no room the searched plan is a ``PlanError`` naming host memory, where the swap
    would have filled the host until it was killed."""
    held_room = {"all": 1 << 40, "none": 0}[room]
    monkeypatch.setattr(planning, "host_room_for_activations", lambda held, ranks: held_room)
    base = make_llama()
    data = make_batches(STEPS)
    attach = {"activation_mode": "swap"}
    if room == "none":
        with pytest.raises(PlanError, match="more activations in host memory than the 0 B"):
            train(copy.deepcopy(base), data, attach=attach, offload_cpu=offload_cpu)
        return
    plain = train(copy.deepcopy(base), data, attach=None, offload_cpu=offload_cpu)
    plans: list = []
    run = train(
        copy.deepcopy(base),
        data,
        attach=attach,
        offload_cpu=offload_cpu,
        before_detach=lambda runtime: plans.append((runtime.plan, runtime.profile)),
    )
    ((plan, profile),) = plans
    assert set(plan.block_policies) == {"swap"} and plan.source == "user+search"
    swapped = sum(unit.act_bytes_keep for unit in profile.blocks)
    assert plan.host_activation_bytes == swapped > 0
    assert "of them held on the host" in plan.summary()
    assert_same_training(plain, run)


@pytest.mark.parametrize("first_step_s", [0.0, None], ids=["long-first-step", "short-first-step"])
def test_a_long_first_profiling_step_is_measured_itself(
    make_llama, make_batches, offload_cpu, monkeypatch, first_step_s
) -> None:
    """A first profiling step of ``MEASURE_FIRST_STEP_S`` or more (a long sequence's: minutes)
    is the measured one: the searched plan runs from the second step, a step sooner than after a
    short first step, and training stays plain autograd's."""
    from autooffload.runtime.control import controller

    if first_step_s is not None:
        monkeypatch.setattr(controller, "MEASURE_FIRST_STEP_S", first_step_s)
    base = make_llama()
    data = make_batches(STEPS)
    plain = train(copy.deepcopy(base), data, attach=None, offload_cpu=offload_cpu)
    model = copy.deepcopy(base)
    sources: list[str] = []

    def before_micro(micro: int) -> None:
        sources.append(rt.runtime_of(model).plan.source)

    run = train(model, data, attach={}, offload_cpu=offload_cpu, before_micro=before_micro)
    # Read before each step's forward, which switches to a plan searched at the step before:
    # one profiling step, then the plan from the second step's forward on; or two, and the
    # third's.
    profiling = 2 if first_step_s is not None else 3
    assert sources[:profiling] == ["profiling step"] * profiling, sources
    assert all(source.startswith("search") for source in sources[profiling:]), sources
    assert_same_training(plain, run)


@pytest.mark.parametrize("first_step_s", [0.0, None], ids=["long-first-step", "short-first-step"])
def test_a_first_step_measured_itself_counts_the_optimizer_state_it_made(
    make_llama, make_batches, offload_cpu, monkeypatch, first_step_s
) -> None:
    """A first profiling step measured itself starts before the user's optimizer has state:
    the state its step made for the params in no chunk (LoRA adapters) counts in the static
    bytes, which a second step's start holds already (on the CPU nothing reads as allocated,
    so there the static bytes are that state alone)."""
    from peft import LoraConfig, get_peft_model

    from autooffload.runtime.control import controller

    if first_step_s is not None:
        monkeypatch.setattr(controller, "MEASURE_FIRST_STEP_S", first_step_s)
    offload_cpu(chunk_size=8_000)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(make_llama(tied=False), config)
    model.to("cpu")
    runtime = rt.runtime_of(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    chunked = {id(s.param) for c in runtime.layout.chunks for s in c.trainable_slots}
    assert trainable and not any(id(p) in chunked for p in trainable)
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    for ids in make_batches(3):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    # AdamW's exp_avg and exp_avg_sq, each the adapters' bytes, and its step counts.
    state = sum(
        v.nbytes for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
    )
    assert state > 2 * sum(p.nbytes for p in trainable)
    assert runtime.profile.static_bytes == (state if first_step_s is not None else 0)


def test_host_room_leaves_the_pools_rounding(monkeypatch) -> None:
    """The search's host room for activations is the share of the available memory less what
    the swapper's pool rounds buffers up by, plus what the pool holds already."""
    from autooffload.runtime.activations.swap import SIZE_CLASS_ROUNDING
    from autooffload.runtime.chunks.host import HostMemory
    from autooffload.runtime.control import host_need

    memory = HostMemory(200 << 30, 100 << 30, cgroup_limited=False)
    monkeypatch.setattr(host_need, "host_memory_now", lambda: memory)
    share = host_need.HOST_ACTIVATIONS_SHARE * (100 << 30)
    room = host_need.host_room_for_activations(held_bytes=5 << 30)
    assert room == int(share / (1 + SIZE_CLASS_ROUNDING)) + (5 << 30)
    assert host_need.host_room_for_activations(local_ranks=2) == int(
        share / 2 / (1 + SIZE_CLASS_ROUNDING)
    )


def test_the_switch_frees_the_profiling_steps_host_buffers(
    make_llama, make_batches, offload_cpu, monkeypatch
) -> None:
    """The profiling steps of a long batch keep the blocks' inputs on the host; the searched
    plan that keeps none holds no host buffer after the switch (the idle ones stayed, counted
    as room for the plan's own)."""
    monkeypatch.setattr(model_activations, "PROFILING_MLP_TILE_TOKENS", TILE)
    monkeypatch.setattr(model_activations, "PROFILING_INPUTS_SHARE", 1e-9)
    # The tiny model's inputs are under the 1 MiB a tensor needs to leave the device.
    swapper = functools.partial(model_activations.ActivationSwapper, min_swap_bytes=0)
    monkeypatch.setattr(model_activations, "ActivationSwapper", swapper)
    held: dict[str, object] = {}

    def read(runtime) -> None:
        held["plan"] = runtime.plan
        held["bytes"] = runtime.activations.swapper.pool.allocated_bytes
        held["allocations"] = runtime.activations.swapper.pool.allocations

    train(
        make_llama(tied=False),
        make_batches(STEPS),
        attach={"budget": "1GiB", "checkpoint_inputs": "cpu", "n_swap": 0},
        offload_cpu=offload_cpu,
        before_detach=read,
    )
    plan = held["plan"]
    assert "search" in plan.source and held["allocations"] > 0, held
    assert plan.n_swap == 0 and "checkpoint_cpu" not in plan.block_policies, plan.summary()
    assert held["bytes"] == 0, held
