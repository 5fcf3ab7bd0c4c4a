"""Profiles survive JSON and reject inconsistent layouts."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from plan_profiles import make_hardware, make_profile

from autooffload.errors import PlanError
from autooffload.plan.profile_types import ChunkProfile, HardwareProfile, ModelProfile


def test_model_profile_round_trips_through_json():
    profile = make_profile(seed=3, tied=True).with_fragmentation(1.07)
    restored = ModelProfile.from_dict(json.loads(json.dumps(profile.to_dict())))
    assert restored == profile
    assert restored.fragmentation_factor == 1.07


def test_hardware_profile_round_trips_and_ignores_unknown_keys():
    hw = make_hardware()
    data = json.loads(json.dumps(hw.to_dict()))
    data["added_in_a_later_version"] = 1
    assert HardwareProfile.from_dict(data) == hw
    # Standard JSON: an unmeasured all-reduce rate (inf) travels as null, and back; a measured
    # one as itself; a dict from before the field existed reads as unmeasured.
    assert hw.allreduce_bps == math.inf and data["allreduce_bps"] is None
    measured = replace(hw, allreduce_bps=4e10)
    text = json.dumps(measured.to_dict(), allow_nan=False)
    assert HardwareProfile.from_dict(json.loads(text)) == measured
    del data["allreduce_bps"]
    assert HardwareProfile.from_dict(data) == hw


def test_units_count_pre_blocks_post():
    profile = make_profile(n_blocks=5)
    assert profile.n_units == 7 and profile.units[0] is profile.pre
    assert profile.units[-1] is profile.post
    profile.validate()


@pytest.mark.parametrize(
    "chunk, match",
    [
        (ChunkProfile(1, units=()), "no units"),
        (ChunkProfile(1, units=(3, 2)), "ascending"),
        (ChunkProfile(1, units=(99,)), "out of range"),
        (ChunkProfile(-1, units=(1,)), "negative"),
    ],
)
def test_validate_rejects_inconsistent_chunks(chunk, match):
    profile = make_profile()
    broken = replace(profile, chunks=(*profile.chunks, chunk))
    with pytest.raises(PlanError, match=match):
        broken.validate()


def test_a_chunk_larger_than_chunk_size_is_valid():
    # A parameter bigger than chunk_size (a bf16 embedding beside nf4 blocks) has a chunk of its
    # own size; the profile keeps the layout's chunk_size, not the largest chunk.
    profile = make_profile()
    oversized = ChunkProfile(4 * profile.chunk_size, units=(0,))
    replace(profile, chunks=(oversized, *profile.chunks)).validate()


def test_a_profile_scales_to_a_longer_sequence_by_its_blocks_fit():
    """``with_sequence_scaled``: a block with a probe fit (``growth``) takes its fields from it,
    relative to its values now (a calibrated compute factor carries over); a block without one,
    and pre and post, grow linearly; the fit survives JSON."""
    base = make_profile(n_blocks=3, seed=1)
    fit = (("fwd_s", 0.001, 0.01, 0.02), ("act_bytes_keep", 1000.0, 3000.0, 500.0))
    first = replace(base.blocks[0], growth=fit, fwd_s=0.031, act_bytes_keep=4500)
    profile = replace(base, blocks=(first, *base.blocks[1:]), host_input_bytes=(100, 100))
    restored = ModelProfile.from_dict(json.loads(json.dumps(profile.to_dict())))
    assert restored == profile
    scaled = profile.with_sequence_scaled(4.0)
    assert scaled.blocks[0].fwd_s == pytest.approx(0.001 + 0.04 + 0.32)
    assert scaled.blocks[0].act_bytes_keep == 1000 + 12000 + 8000
    assert scaled.blocks[0].act_bytes_checkpoint == 4 * first.act_bytes_checkpoint
    plain = base.blocks[1]
    assert scaled.blocks[1].fwd_s == pytest.approx(4 * plain.fwd_s)
    assert scaled.blocks[1].act_bytes_keep == 4 * plain.act_bytes_keep
    assert scaled.post.bwd_s == pytest.approx(4 * base.post.bwd_s)
    assert scaled.batch_tokens == 4 * base.batch_tokens
    assert scaled.host_input_bytes == (400, 400)
    assert scaled.static_bytes == base.static_bytes and scaled.chunks == base.chunks
    # Twice as slow since it was measured: twice as slow at the longer length too.
    slower = profile.with_compute_scaled(2.0).with_sequence_scaled(4.0)
    assert slower.blocks[0].fwd_s == pytest.approx(2 * scaled.blocks[0].fwd_s)
