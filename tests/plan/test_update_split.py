"""``plan/update_split.backward_split``: where the GPU's updates in the backward put their bytes."""

from __future__ import annotations

import dataclasses

import numpy as np
from plan_profiles import MiB, make_hardware, make_profile

from autooffload.plan.update_split import backward_gpu_chunks, backward_split


def _profile(**changes):
    """Five 64 MiB chunks over six units, each chunk on two: (0,1), (1,2), (2,3), (3,4), (4,5);
    32M trainable elements each, 4 B of Adam state per element (bf16 moments)."""
    profile = make_profile(n_blocks=4, chunk_size=64 * MiB, block_param_bytes=64 * MiB)
    assert [c.units for c in profile.chunks] == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    return dataclasses.replace(profile, update_in_backward=True, **changes)


def test_the_lowest_offloaded_chunks_bring_their_state_in_one_window_ahead_and_send_it_out():
    split = backward_split(_profile(gpu_update_in_backward=2), make_hardware(), np.array([1]))
    # n_persist 1: chunks 1-4 offloaded; the GPU takes 1 and 2, the CPU 3 and 4.
    assert split.gpu_chunks.tolist() == [2]
    assert split.cpu_numel.tolist() == [2 * 32 * 2**20]
    # The CPU's lowest chunk is 3: the forward waits for the CPU there, from unit 3 on.
    assert split.lowest_first.tolist() == [3] and split.lowest_numel.tolist() == [32 * 2**20]
    assert split.cpu_units.tolist() == [[False, False, False, True, True, False]]
    # Chunk c's 128 MiB of state comes in during the window above its last unit (3 for chunk
    # 1, 4 for chunk 2), and goes out with its 64 MiB of weights where its 64 MiB of gradients
    # would have gone (its first unit): 128 MiB more there.
    assert (split.state_in // MiB).tolist() == [[0, 0, 0, 128, 128, 0]]
    assert (split.out_delta // MiB).tolist() == [[0, 128, 128, 0, 0, 0]]
    # On the device from that window down to the unit below the chunk.
    assert (split.scratch // MiB).tolist() == [[128, 256, 256, 256, 128, 0]]


def test_the_setting_and_the_update_mode_decide_whether_any_chunk_goes():
    hw = make_hardware()
    assert backward_gpu_chunks(_profile(gpu_update_in_backward=0), hw, 1) == []
    at_step = dataclasses.replace(_profile(gpu_update_in_backward=3), update_in_backward=False)
    assert backward_gpu_chunks(at_step, hw, 1) == []
    assert backward_gpu_chunks(_profile(gpu_update_in_backward=3), hw, 1) == [1, 2, 3]
    assert backward_gpu_chunks(_profile(gpu_update_in_backward=9), hw, 3) == [3, 4]
    # auto: a CPU too slow to finish before the forward needs it moves chunks to the GPU,
    # lowest first; a fast one keeps them all.
    slow = backward_gpu_chunks(
        _profile(gpu_update_in_backward=-1), make_hardware(cpu_optim_params_per_s=1e8), 1
    )
    assert slow and slow == list(range(1, 1 + len(slow)))
    fast = make_hardware(cpu_optim_params_per_s=1e13)
    assert backward_gpu_chunks(_profile(gpu_update_in_backward=-1), fast, 1) == []
