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
