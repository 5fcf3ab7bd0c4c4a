"""Chunk ownership and the per-rank cost view of sharded CPU optimizer state (the collectives
themselves run in tests/runtime/test_distributed.py under torchrun)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "plan"))
from plan_profiles import make_hardware, make_profile  # noqa: E402

from autooffload.bench.workloads import LLAMA3_8B, LLAMA32_3B  # noqa: E402
from autooffload.plan.cost_time import predict_step_time  # noqa: E402
from autooffload.plan.profile_types import HardwareProfile  # noqa: E402
from autooffload.plan.types import Knobs  # noqa: E402
from autooffload.runtime.parallel.sharding import (  # noqa: E402
    NotConsolidatedError,
    Sharding,
    balanced_owners,
)


def chunks(trainable: list[bool]) -> SimpleNamespace:
    return SimpleNamespace(
        chunk_size=1 << 20,
        chunks=[
            SimpleNamespace(index=i, nbytes=1 << 20, trainable_slots=[object()] if t else [])
            for i, t in enumerate(trainable)
        ],
    )


def sharding(rank: int, world: int, trainable: list[bool]) -> Sharding:
    dp = SimpleNamespace(rank=rank, world_size=world, nccl=False, device=torch.device("cpu"))
    return Sharding(dp, chunks(trainable))  # type: ignore[arg-type]


def hardware() -> HardwareProfile:
    return make_hardware(h2d_bps=50e9, d2h_bps=50e9, duplex_bps=90e9, cpu_optim_params_per_s=2e9)


def test_chunks_are_owned_round_robin_and_every_offloaded_one_is_sharded():
    ranks = [sharding(r, 2, [True, True, False, True, True]) for r in range(2)]
    for index in range(5):
        assert sum(s.owns(index) for s in ranks) == 1
        # Exactly one host copy of every chunk, frozen ones included: its owner's.
        assert sum(s.hosts(index) for s in ranks) == 1
    assert [ranks[0].owns(i) for i in range(5)] == [True, False, True, False, True]
    persistent = {0}
    assert [ranks[1].applies(i, persistent) for i in range(5)] == [
        False,  # persistent: replicated on every GPU, updated by the user's optimizer
        True,
        True,  # frozen: no optimizer state, but its bytes come from the owner too
        True,
        True,
    ]
    assert ranks[0].trainable == {0, 1, 3, 4}


def test_equal_chunks_stay_round_robin_and_an_oversized_one_counts_as_its_bytes():
    assert balanced_owners([5] * 7, 3) == [0, 1, 2, 0, 1, 2, 0]
    # Uneven chunks (a block split over two) still alternate.
    assert balanced_owners([16, 12, 16, 17, 12, 17, 12, 16, 9], 2) == [0, 1] * 4 + [0]
    # A chunk four blocks large (a vocabulary) and 12 blocks: its owner skips its turns until
    # the others hold about as much, then the rotation takes it again.
    weights = [4, *[1] * 12, 0]
    owners = balanced_owners(weights, 4, oversized=[0])
    assert owners == [0, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 0]
    loads = [sum(w for w, o in zip(weights, owners, strict=True) if o == r) for r in range(4)]
    assert loads == [4, 4, 4, 4]
    # Two ranks: the other takes the blocks until it holds about as much.
    assert balanced_owners([4, *[1] * 8], 2, oversized=[0]) == [0, 1, 1, 1, 1, 0, 1, 0, 1]


def meta_llama_layout(dims: dict):
    """The chunk layout of a Llama with the bench's ``dims`` (real sizes, on the meta device: no
    memory)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from autooffload.runtime.blocks import discover_groups
    from autooffload.runtime.placement import chunk_layout
    from autooffload.runtime.quantized import QuantizedParams

    config = LlamaConfig(**dims)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    if config.tie_word_embeddings:
        model.tie_weights()
    return chunk_layout(discover_groups(model), [], QuantizedParams.collect(model.modules()), None)


@pytest.mark.parametrize(
    ("dims", "world"),
    [(LLAMA32_3B, 2), (LLAMA32_3B, 4), (LLAMA3_8B, 2), (LLAMA3_8B, 4)],
    ids=["3b-x2", "3b-x4", "8b-x2", "8b-x4"],
)
def test_every_rank_hosts_about_its_share_of_a_large_vocabulary_model(dims, world):
    """Ownership by bytes, as attach assigns it: the vocabulary chunks (788 MB at 3B, tied;
    1.05 GB each for 8B's embedding and head, against 201 and 436 MB blocks) no longer land on
    rank 0 on top of its share of blocks. Round robin hosted 2.05 GiB on rank 0 and 1.31 on
    the others at 3B on four ranks, and 8.46 against 6.50 at 8B on two (the embedding and the
    head on rank 0): every rank's host store, gradient staging and optimizer state in
    proportion."""
    from autooffload.runtime.control.host_need import chunk_host_bytes

    layout = meta_llama_layout(dims)
    block = max(c.nbytes for c in layout.chunks[1:-1])
    weights = chunk_host_bytes(layout, master_weights=False)
    hosted = []
    for rank in range(world):
        dp = SimpleNamespace(rank=rank, world_size=world, nccl=False, device=torch.device("cpu"))
        s = Sharding(dp, layout, weights)  # type: ignore[arg-type]
        hosted.append(sum(c.nbytes for c in layout.chunks if s.hosts(c.index)))
    assert sum(hosted) == layout.total_bytes
    assert max(hosted) - min(hosted) <= 1.5 * block, [h / (1 << 30) for h in hosted]


def test_per_rank_hardware_view_divides_cpu_work_and_adds_the_broadcast():
    s = sharding(0, 4, [True])
    s.broadcast_bps = 200e9
    hw = s.effective_hardware(hardware())
    assert hw.cpu_optim_params_per_s == pytest.approx(8e9)
    assert hw.d2h_bps == pytest.approx(200e9)
    # A gathered byte: a quarter of an H2D byte (the owner's copy), then one broadcast byte.
    assert 1 / hw.h2d_bps == pytest.approx(1 / (4 * 50e9) + 1 / 200e9)
    # An unmeasured broadcast (infinitely fast) leaves only the N-fold shares.
    s.broadcast_bps = math.inf
    assert s.effective_hardware(hardware()).h2d_bps == pytest.approx(200e9)


def test_gradients_cost_their_collective_then_the_owners_copy():
    """A gradient byte: the collective (every rank takes part), then the D2H copy (under
    sharding the owner's, 1/N of the chunks per rank)."""
    from autooffload.runtime.parallel.distributed import DataParallel

    dp = object.__new__(DataParallel)
    dp.gradient_bps, dp.allreduce_bps = 100e9, 80e9
    s = sharding(0, 2, [True])
    hw = dp.effective_hardware(s.effective_hardware(hardware()))
    assert 1 / hw.d2h_bps == pytest.approx(1 / (2 * 50e9) + 1 / 100e9)
    assert dp.effective_hardware(hardware()).h2d_bps == hardware().h2d_bps
    # Persistent chunks' all-reduce: its own measured rate, for the cost model's queue.
    assert hardware().allreduce_bps == math.inf and hw.allreduce_bps == 80e9
    # Unmeasured (infinitely fast): the copy alone.
    dp.gradient_bps = dp.allreduce_bps = math.inf
    assert dp.effective_hardware(hardware()).d2h_bps == pytest.approx(50e9)
    assert dp.effective_hardware(hardware()).allreduce_bps == math.inf


def test_sharding_shortens_a_cpu_bound_predicted_step():
    profile = make_profile(n_blocks=8, fwd_s=0.001)
    knobs = Knobs(n_persist=0, n_buffer=2)
    hw = hardware()
    alone_s, alone, _ = predict_step_time(profile, hw, knobs)
    s = sharding(0, 2, [True])
    s.broadcast_bps = 300e9
    shared_s, shared, _ = predict_step_time(profile, s.effective_hardware(hw), knobs)
    assert shared_s < alone_s
    assert shared["cpu_optim_s"] == pytest.approx(alone["cpu_optim_s"] / 2)


def test_reading_unconsolidated_state_names_the_fix():
    error = sharding(1, 2, [True]).not_consolidated("model.state_dict()")
    assert isinstance(error, NotConsolidatedError)
    assert "autooffload.consolidate(model) on every rank" in str(error)
    assert "AUTOOFFLOAD_SHARD_OPTIMIZER=off" in str(error)


def test_shapes_only_placeholders_keep_tied_parameters_one_storage():
    """Inside ``shapes_only`` a chunk another rank hosts reads as placeholders, not meta
    tensors: safetensors' ``load_model`` (Accelerator.load_state) finds tied parameters by
    their storage and skips meta tensors, so a tied embedding and head of such a chunk read as
    two tensors, one missing from the file (a flaky failure, with the plan)."""
    from safetensors.torch import _remove_duplicate_names

    from autooffload.runtime.chunks.layout import ParamSlot
    from autooffload.runtime.parallel.sharding import Sharding, shapes_only

    weight = torch.nn.Parameter(torch.zeros(6, 4, dtype=torch.bfloat16))
    slot = ParamSlot(weight, "embed.weight", 0, 48, weight.shape, weight.dtype)
    sharding = object.__new__(Sharding)  # only the state weight_alias reads
    sharding._weights, sharding.shapes_only, sharding.placeholders = {}, False, {}
    runtime = SimpleNamespace(manager=SimpleNamespace(sharding=sharding))
    with shapes_only([runtime]):
        embed, head = sharding.weight_alias(3, slot), sharding.weight_alias(3, slot)
        assert not embed.is_meta and embed.shape == weight.shape and embed.dtype == weight.dtype
        assert embed.data_ptr() == head.data_ptr()
        removed = _remove_duplicate_names(
            {"embed.weight": embed, "head.weight": head}, preferred_names=["embed.weight"]
        )
        assert removed == {"embed.weight": ["head.weight"]}
    assert sharding.placeholders == {} and not sharding.shapes_only
