"""Tiled MLPs in the planner: the variant's costs follow their formulas, and the search tiles
only where the budget leaves no faster untiled plan."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autooffload.errors import PlanError
from autooffload.plan.configuration import with_checkpoint_inputs_on_cpu, with_mlp_tiles
from autooffload.plan.cost_memory import activation_events, peak_breakdown
from autooffload.plan.cost_time import predict_step_time
from autooffload.plan.search import search, search_all
from autooffload.plan.types import Knobs
from tests.plan.plan_profiles import MiB, make_hardware, make_profile

TOKENS = 65536


def long_profile(mlp_act: int = 160 * MiB, n_blocks: int = 8):
    """A decoder at a long sequence whose blocks keep most of their bytes in the MLP."""
    profile = make_profile(n_blocks=n_blocks)
    blocks = tuple(
        replace(
            unit,
            act_bytes_keep=unit.act_bytes_keep + mlp_act,
            fwd_transient_bytes=unit.fwd_transient_bytes + mlp_act // 4,
            bwd_transient_bytes=mlp_act // 2,
            mlp_act_bytes=mlp_act,
            mlp_fwd_transient_bytes=mlp_act // 4 + 32 * MiB,
            mlp_bwd_transient_bytes=mlp_act // 2,
            mlp_fwd_s=0.4 * unit.fwd_s,
        )
        for unit in profile.blocks
    )
    return replace(profile, blocks=blocks, batch_tokens=TOKENS)


def test_variant_follows_its_formulas() -> None:
    profile = long_profile()
    tiled = with_mlp_tiles(profile, 8192)
    r = 8192 / TOKENS
    for unit, new in zip(profile.blocks, tiled.blocks):
        a, x = unit.mlp_act_bytes, unit.act_bytes_checkpoint
        assert new.act_bytes_keep == unit.act_bytes_keep - a
        # The block's peaks lie in its MLP (transients no larger than the MLP's own).
        fwd = unit.mlp_fwd_transient_bytes
        assert new.fwd_transient_bytes == int(x + r * (a + max(fwd - x, 0)))
        bwd = unit.mlp_bwd_transient_bytes
        assert new.bwd_transient_bytes == int(x + r * (a + max(bwd - x, 0)))
        assert new.bwd_s == pytest.approx(unit.bwd_s + unit.mlp_fwd_s)
        assert new.fwd_s == unit.fwd_s
    assert tiled.mlp_tile_tokens == 8192
    assert (tiled.pre, tiled.post) == (profile.pre, profile.post)


def test_peak_outside_the_mlp_keeps_its_absolute_size() -> None:
    profile = long_profile()
    unit = profile.blocks[0]
    big = replace(unit, bwd_transient_bytes=unit.mlp_bwd_transient_bytes + 64 * MiB)
    new = with_mlp_tiles(replace(profile, blocks=(big, *profile.blocks[1:])), 8192).blocks[0]
    assert (
        new.act_bytes_keep + new.bwd_transient_bytes == big.act_bytes_keep + big.bwd_transient_bytes
    )


def test_a_block_probed_tiled_keeps_what_was_measured_grown_to_the_plans_tile() -> None:
    """The probe ran the block tiled (in ``PROBE_TILES`` tiles): its saved bytes and peaks are
    the measured ones, above or below the formulas' (a tiled norm saves its input; a peak the
    untiled block reached after its MLP held intermediates tiling removes), each peak grown by
    the intermediates of a tile that holds a larger share of the batch than the probe's."""
    from autooffload.plan.profile_types import PROBE_TILES

    profile = long_profile()
    unit = profile.blocks[0]
    formula = with_mlp_tiles(replace(profile, blocks=(unit,)), 8192).blocks[0]
    keep = formula.act_bytes_keep  # keep - A
    measured_keep = keep + 32 * MiB
    high = replace(
        unit,
        tiled_act_bytes_keep=measured_keep,
        tiled_fwd_peak_bytes=keep + formula.fwd_transient_bytes + 96 * MiB,
        tiled_bwd_peak_bytes=keep + formula.bwd_transient_bytes + 200 * MiB,
    )
    low = replace(
        unit,
        tiled_act_bytes_keep=measured_keep,
        tiled_fwd_peak_bytes=measured_keep,
        tiled_bwd_peak_bytes=measured_keep,
    )
    a, x = unit.mlp_act_bytes, unit.act_bytes_checkpoint
    own_f = max(unit.mlp_fwd_transient_bytes - x, 0)
    own_b = max(unit.mlp_bwd_transient_bytes - x, 0)
    for tile in (4096, 8192, 32768):
        larger = max(0.0, tile / TOKENS - 1 / PROBE_TILES)
        blocks = with_mlp_tiles(replace(profile, blocks=(high, low)), tile).blocks
        assert blocks[0].act_bytes_keep == blocks[1].act_bytes_keep == measured_keep
        for new, probed in zip(blocks, (high, low), strict=True):
            assert new.act_bytes_keep + new.fwd_transient_bytes == (
                probed.tiled_fwd_peak_bytes + int(larger * (a + own_f))
            )
            assert new.act_bytes_keep + new.bwd_transient_bytes == (
                probed.tiled_bwd_peak_bytes + int(larger * (a + own_b))
            )
        if tile == 4096:  # the probe's own share: the measured peaks as they are
            assert blocks[1].fwd_transient_bytes == blocks[1].bwd_transient_bytes == 0


def test_memory_term_shrinks_with_the_tile_as_the_formula_says() -> None:
    profile = long_profile()
    knobs = Knobs(n_persist=0, n_buffer=4, n_swap=0, n_checkpoint=profile.n_blocks)
    _, bwd_untiled = activation_events(profile, knobs)
    u = profile.n_blocks  # the last block: every other block's input is saved before it
    unit = profile.blocks[-1]
    a, x, b = unit.mlp_act_bytes, unit.act_bytes_checkpoint, unit.mlp_bwd_transient_bytes
    previous = None
    for tile in (4096, 8192, 16384, 32768):
        _, bwd = activation_events(with_mlp_tiles(profile, tile), knobs)
        expected = bwd_untiled[u] - a - b + int(x + tile / TOKENS * (a + max(b - x, 0)))
        assert bwd[u] == expected
        if previous is not None:
            # Doubling the tile adds one more tile's share of intermediates and their gradients.
            step = tile / 2 / TOKENS * (a + max(b - x, 0))
            assert bwd[u] - previous == pytest.approx(step, abs=2)
        previous = bwd[u]
    hw = make_hardware()
    peaks = [peak_breakdown(with_mlp_tiles(profile, t), hw, knobs)["peak"] for t in (4096, 32768)]
    assert peaks[0] < peaks[1] < peak_breakdown(profile, hw, knobs)["peak"]


def test_tiling_charges_the_backward_second_mlp_forward() -> None:
    profile = long_profile()
    knobs = Knobs(n_persist=0, n_buffer=4, n_swap=0, n_checkpoint=0)
    hw = make_hardware(h2d_bps=1e15, d2h_bps=1e15, duplex_bps=2e15)  # compute-bound
    untiled = predict_step_time(profile, hw, knobs)[0]
    tiled = predict_step_time(with_mlp_tiles(profile, 8192), hw, knobs)[0]
    assert tiled - untiled == pytest.approx(sum(u.mlp_fwd_s for u in profile.blocks), rel=1e-6)


def test_composes_with_checkpoint_inputs_on_host_in_order() -> None:
    profile = long_profile()
    hw = make_hardware()
    both = with_checkpoint_inputs_on_cpu(with_mlp_tiles(profile, 8192), hw)
    assert both.mlp_tile_tokens == 8192 and both.checkpoint_inputs_on_cpu
    with pytest.raises(PlanError, match="before with_checkpoint_inputs_on_cpu"):
        with_mlp_tiles(with_checkpoint_inputs_on_cpu(profile, hw), 8192)


def smallest_peak(profile, hw, tiles) -> int:
    return int(
        search_all({profile.chunk_size: profile}, hw, None, mlp_tiles=tiles).peak_bytes.min()
    )


def test_search_leaves_mlps_untiled_where_the_budget_does_not_bind() -> None:
    profile = long_profile()
    hw = make_hardware()
    profiles = {profile.chunk_size: profile}
    assert search(profiles, hw, None).mlp_tile_tokens == 0
    unbounded = search(profiles, hw, None)
    roomy = search(profiles, hw, unbounded.predicted_peak_bytes + MiB)
    assert roomy.mlp_tile_tokens == 0
    assert roomy.configures_like(unbounded)


def test_search_tiles_when_nothing_untiled_fits() -> None:
    profile = long_profile()
    hw = make_hardware()
    profiles = {profile.chunk_size: profile}
    untiled_floor = smallest_peak(profile, hw, ())
    tiled_floor = smallest_peak(profile, hw, None)
    assert tiled_floor < untiled_floor
    budget = (untiled_floor + tiled_floor) // 2
    with pytest.raises(PlanError):
        search(profiles, hw, budget, mlp_tiles=())
    plan = search(profiles, hw, budget)
    assert plan.mlp_tile_tokens in (8192, 16384, 32768)
    assert plan.predicted_peak_bytes <= budget
    variant = with_mlp_tiles(profile, plan.mlp_tile_tokens)
    assert peak_breakdown(variant, hw, plan.knobs)["peak"] == plan.predicted_peak_bytes
    assert "MLPs: tiled, " in plan.summary()


def test_search_tiles_when_it_lets_a_faster_plan_fit() -> None:
    profile = long_profile()
    # A slow link: swapped activations cannot hide behind the compute.
    hw = make_hardware(h2d_bps=4e9, d2h_bps=4e9, duplex_bps=6e9)
    profiles = {profile.chunk_size: profile}
    # Room for every block kept once the MLPs are tiled, not without: untiled blocks must then
    # checkpoint or swap, which costs more than the backward's second MLP forward.
    keep_all = Knobs(n_persist=0, n_buffer=4)
    budget = int(peak_breakdown(with_mlp_tiles(profile, 32768), hw, keep_all)["peak"])
    untiled = search(profiles, hw, budget, mlp_tiles=())
    plan = search(profiles, hw, budget)
    assert plan.mlp_tile_tokens > 0
    assert plan.predicted_step_s < untiled.predicted_step_s


def test_no_tiling_without_a_tileable_mlp_or_below_one_tile() -> None:
    hw = make_hardware()
    plain = make_profile(n_blocks=8)  # no MLP measured
    floor = smallest_peak(plain, hw, None)
    with pytest.raises(PlanError):
        search({plain.chunk_size: plain}, hw, floor - 1)
    short = replace(long_profile(), batch_tokens=8192)  # no tile below the batch's tokens
    floor = smallest_peak(short, hw, None)
    assert floor == smallest_peak(short, hw, ())
    assert search({short.chunk_size: short}, hw, floor).mlp_tile_tokens == 0


@pytest.mark.parametrize("coarse", [True, False], ids=["with-quarter", "without-quarter"])
@pytest.mark.parametrize("elsewhere_mib", [0, 150, 250, 400, 1500])
def test_a_tile_between_the_probes_reads_between_their_measured_peaks(
    elsewhere_mib: int, coarse: bool
) -> None:
    """The probe measures the tiled block's peaks with tiles of 1/64, 1/16 and 1/4 of the
    batch. A block's tiled peak is the larger of one in its MLP, rising with the tile, and one
    elsewhere (its attention's backward), flat: the planner's peak between two measured shares
    is the chord through them, below the smallest that one's, above the largest that one's
    grown by the larger tile's intermediates. Never below the true peak, equal to it at the
    measured shares; where the peak lies elsewhere at all of them, the tile moves nothing up to
    the largest. (Llama-3-8B LoRA at 524288 tokens: the plan's 8192-token tile is 1/64 of the
    batch; Llama 3.6B at 65536: 1/8.)"""
    from autooffload.plan.profile_types import PROBE_COARSE_TILES, PROBE_FINE_TILES, PROBE_TILES

    assert (PROBE_FINE_TILES, PROBE_TILES, PROBE_COARSE_TILES) == (64, 16, 4)
    profile = long_profile(mlp_act=2048 * MiB)
    unit = profile.blocks[0]
    # The MLP's own forward and backward peaks alike: one slope for both sides.
    unit = replace(unit, mlp_fwd_transient_bytes=unit.mlp_bwd_transient_bytes)
    keep = 300 * MiB
    # A batch's worth of MLP intermediates and their gradients (~3 GiB): the in-MLP peak's slope.
    per_batch = unit.mlp_act_bytes + unit.mlp_bwd_transient_bytes - unit.act_bytes_checkpoint
    elsewhere = keep + elsewhere_mib * MiB

    def true_peak(share: float) -> int:
        return max(elsewhere, keep + int(share * per_batch))

    quarter = true_peak(1 / 4) if coarse else 0
    probed = replace(
        unit,
        tiled_act_bytes_keep=keep,
        tiled_fwd_peak_bytes=true_peak(1 / 16),
        tiled_bwd_peak_bytes=true_peak(1 / 16),
        tiled_fine_fwd_peak_bytes=true_peak(1 / 64),
        tiled_fine_bwd_peak_bytes=true_peak(1 / 64),
        tiled_coarse_fwd_peak_bytes=quarter,
        tiled_coarse_bwd_peak_bytes=quarter,
    )
    measured = [(1 / 64, true_peak(1 / 64)), (1 / 16, true_peak(1 / 16))]
    measured += [(1 / 4, quarter)] if coarse else []
    tiled = replace(profile, blocks=(probed,))
    for tile in (256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 16384, 32768):
        share = tile / TOKENS
        new = with_mlp_tiles(tiled, tile).blocks[0]
        predicted = new.act_bytes_keep + new.bwd_transient_bytes
        assert new.act_bytes_keep + new.fwd_transient_bytes == predicted
        assert predicted >= true_peak(share) - 1, (tile, predicted, true_peak(share))
        (lo, low), (hi, high) = measured[0], measured[-1]
        if share <= lo:
            expected = low
        elif share >= hi:
            expected = high + (share - hi) * per_batch
        else:
            (lo, low), (hi, high) = next(
                (a, b) for a, b in zip(measured, measured[1:]) if a[0] <= share <= b[0]
            )
            expected = low + (share - lo) / (hi - lo) * (high - low)
        assert predicted == pytest.approx(expected, abs=1), tile
        if share in (s for s, _ in measured):
            assert predicted == true_peak(share)  # exact at a measured share
    if elsewhere_mib == 0:  # in the MLP at every share: a quarter of the tile, a quarter less
        at_fine = with_mlp_tiles(tiled, 1024).blocks[0]
        at_probe = with_mlp_tiles(tiled, 4096).blocks[0]
        assert at_probe.bwd_transient_bytes - at_fine.bwd_transient_bytes == (
            int(per_batch / 16) - int(per_batch / 64)
        )
    if elsewhere_mib == 1500 and coarse:  # elsewhere up to a quarter: the tile moves nothing
        for tile in (1024, 4096, 8192, 16384):
            new = with_mlp_tiles(tiled, tile).blocks[0]
            assert new.act_bytes_keep + new.bwd_transient_bytes == elsewhere


def test_a_finer_tile_measured_no_lower_keeps_the_higher_peak() -> None:
    """Noise, or a smaller tile's own overheads: where the finer tile's peak is not below the
    coarser one's, a tile smaller than the probe's gets the higher of the two; where the finer
    peak was not measured (a profile from before it was), the coarser one."""
    profile = long_profile()
    unit = profile.blocks[0]
    keep, coarse, fine = 300 * MiB, 700 * MiB, 720 * MiB
    probed = replace(
        unit,
        tiled_act_bytes_keep=keep,
        tiled_fwd_peak_bytes=coarse,
        tiled_bwd_peak_bytes=coarse,
        tiled_fine_fwd_peak_bytes=fine,
        tiled_fine_bwd_peak_bytes=fine,
    )
    for tile in (512, 2048):
        new = with_mlp_tiles(replace(profile, blocks=(probed,)), tile).blocks[0]
        assert new.act_bytes_keep + new.bwd_transient_bytes == fine
        unmeasured = replace(probed, tiled_fine_fwd_peak_bytes=0, tiled_fine_bwd_peak_bytes=0)
        old = with_mlp_tiles(replace(profile, blocks=(unmeasured,)), tile).blocks[0]
        assert old.act_bytes_keep + old.bwd_transient_bytes == coarse
    # No peak above 0 (a CPU probe's backward may free what it saved): the probe's own share's.
    zero = replace(unmeasured, tiled_fwd_peak_bytes=0, tiled_bwd_peak_bytes=0)
    for tile in (512, 8192):
        new = with_mlp_tiles(replace(profile, blocks=(zero,)), tile).blocks[0]
        grown = max(0.0, tile / TOKENS - 1 / 16)
        a, x = zero.mlp_act_bytes, zero.act_bytes_checkpoint
        own_b = max(zero.mlp_bwd_transient_bytes - x, 0)
        assert new.act_bytes_keep + new.bwd_transient_bytes == int(grown * (a + own_b))
