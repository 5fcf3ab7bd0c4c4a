"""The profiling step's block probe (runtime/control/profiler.py), in the CPU simulation: it runs
each block class once through its ``__call__`` (so the hooks of HF and others run, as in the
step) with the runtime's own hooks stepping aside (no trace entry, no gather of their own)."""

from __future__ import annotations

import pytest
import torch

from autooffload import runtime as rt
from autooffload.runtime.control import probe

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_probe_runs_blocks_through_call_with_the_runtimes_hooks_muted(
    make_llama, offload_cpu, make_batches
):
    model = make_llama(n_layers=4)
    offload_cpu()
    model.to("cpu")
    runtime = rt.runtime_of(model)
    seen: list[bool] = []
    block = next(g.module for g in runtime.groups if g.is_block)
    block.register_forward_pre_hook(
        lambda module, args: seen.append(runtime.step_state.hooks_muted)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for ids in make_batches(4):  # two profiling steps, then the searched plan
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert runtime.profile is not None and len(runtime.profile.blocks) == 4
    # The block's own pre-hook saw the probe's runs (muted; PROBE_RUNS of them) between the
    # steps' calls (not muted): the probe went through __call__, and the hooks are live again.
    from autooffload.runtime.control.probe import PROBE_RUNS

    assert seen.count(True) == PROBE_RUNS
    assert seen[-1] is False and not runtime.step_state.hooks_muted
    assert runtime.plan.source.startswith("search") and losses[-1] < losses[0]


def test_a_step_of_micro_batches_is_profiled_on_its_first_and_counted(
    make_llama, offload_cpu, make_batches
):
    """Under gradient accumulation the profiling step runs several forwards and backwards:
    the pre and post units are timed on the first micro-batch (the last forward's end against
    the first backward's start read a negative post forward, and the plan's compute went
    negative), and the profile says how many micro-batches a step has."""
    model = make_llama(n_layers=2)
    offload_cpu()
    model.to("cpu")
    runtime = rt.runtime_of(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = make_batches(9)
    for step in range(3):  # two profiling steps, then the plan's: 3 micro-batches each
        for ids in batches[3 * step : 3 * step + 3]:
            (model(input_ids=ids, labels=ids).loss / 3).backward()
        optimizer.step()
        optimizer.zero_grad()
    profile = runtime.profile
    assert profile is not None and profile.micro_batches == 3 and profile.grad_accumulation
    for unit in (profile.pre, profile.post):
        assert unit.fwd_s >= 0 and unit.bwd_s >= 0, unit
    assert profile.batch_tokens == batches[0].numel()  # one micro-batch's
    assert "3 micro-batches of accumulation" in runtime.plan.summary()


def _probed_block(make_llama, offload_cpu, attention: str, long: bool, monkeypatch, seq=256):
    """The first block's profile of one attached step on a (1, ``seq``) batch; ``long``: the
    batch reads as long (the probe runs on slices of 32, 64 and 128 positions at 256)."""
    from autooffload.runtime.activations import model_activations

    share = 1e-9 if long else model_activations.PROFILING_INPUTS_SHARE
    monkeypatch.setattr(model_activations, "PROFILING_INPUTS_SHARE", share)
    monkeypatch.setattr(probe, "PROBE_BUDGET_SHARE", 64 * 32 * 32 * 4 * 32 / (1 << 30))
    model = make_llama(n_layers=2)
    model.config._attn_implementation = attention
    offload_cpu(budget="1GiB", checkpoint_inputs="cpu")
    model.to("cpu")
    runtime = rt.runtime_of(model)
    probed: set[int] = set()  # the sequence lengths the probe ran the first block on
    first = next(g.module for g in runtime.groups if g.is_block)
    first.register_forward_pre_hook(
        lambda module, args: (
            probed.add(args[0].shape[1]) if runtime.step_state.hooks_muted else None
        )
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(
        0, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0)
    )
    for _ in range(3):  # two profiling steps, then the searched plan
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    block = runtime.profile.blocks[0]
    import autooffload

    autooffload.disable()
    assert probed == ({seq // 8, seq // 4, seq // 2} if long else {seq}), probed
    return block


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_long_batch_is_probed_on_slices_and_extrapolated(
    make_llama, offload_cpu, monkeypatch, attention
):
    """The kept block's saved bytes and its MLP's, measured on 32, 64 and 128 of 256 positions
    and extrapolated, are those of the whole batch: linear in the positions with flash
    attention, quadratic in part with eager attention's probabilities, plus a constant (on the
    CPU the weights' transposed views count as saved)."""
    whole = _probed_block(make_llama, offload_cpu, attention, False, monkeypatch)
    sliced = _probed_block(make_llama, offload_cpu, attention, True, monkeypatch)
    assert sliced.act_bytes_checkpoint == whole.act_bytes_checkpoint
    assert sliced.act_bytes_keep == pytest.approx(whole.act_bytes_keep, rel=1e-3)
    assert sliced.mlp_act_bytes == pytest.approx(whole.mlp_act_bytes, rel=1e-3)
    assert whole.mlp_act_bytes > 0 and sliced.fwd_s > 0


def test_a_batch_longer_than_a_tile_is_also_probed_with_its_mlp_tiled(
    make_llama, offload_cpu, monkeypatch
):
    """Where the search may tile the MLPs (the batch is longer than its smallest tile), the
    probe also runs the block with its MLP and norms tiled: on the CPU its saved bytes, which
    leave out the MLP's intermediates and the norms' copies: no more than the kept block's less
    ``mlp_act_bytes`` (what ``with_mlp_tiles`` counts), and well below the untiled block's."""
    untiled = _probed_block(make_llama, offload_cpu, "sdpa", True, monkeypatch)
    assert untiled.tiled_act_bytes_keep == untiled.tiled_bwd_peak_bytes == 0
    monkeypatch.setattr(probe, "MLP_TILE_TOKENS", (64,))
    block = _probed_block(make_llama, offload_cpu, "sdpa", True, monkeypatch)
    assert block.mlp_act_bytes > 0
    assert 0 < block.tiled_act_bytes_keep <= block.act_bytes_keep - block.mlp_act_bytes
    assert block.tiled_act_bytes_keep < 0.6 * block.act_bytes_keep
    # No peaks on the CPU: the saved bytes, the same with finer and coarser tiles (a tiled MLP
    # saves its input whatever the tile).
    assert block.tiled_fwd_peak_bytes == block.tiled_bwd_peak_bytes == block.tiled_act_bytes_keep
    for side in ("fine", "coarse"):
        fwd = getattr(block, f"tiled_{side}_fwd_peak_bytes")
        bwd = getattr(block, f"tiled_{side}_bwd_peak_bytes")
        assert fwd == bwd == pytest.approx(block.tiled_act_bytes_keep, rel=0.02), side
        assert getattr(untiled, f"tiled_{side}_bwd_peak_bytes") == 0


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_long_batchs_fit_predicts_a_longer_batch(make_llama, offload_cpu, monkeypatch, attention):
    """The fit of a block probed on slices of 256 positions (``UnitProfile.growth``), scaled to
    twice the length (``ModelProfile.with_sequence_scaled``), gives the saved bytes measured on
    512 positions: eager attention's quadratic probabilities included, which a linear scaling
    of the 256-position figures misses."""
    from autooffload.plan.profile_types import ModelProfile

    # Whole first: the sliced probe's share setting stays for the rest of the test.
    longer = _probed_block(make_llama, offload_cpu, attention, False, monkeypatch, seq=512)
    sliced = _probed_block(make_llama, offload_cpu, attention, True, monkeypatch)
    assert sliced.growth and not longer.growth
    profile = ModelProfile(
        chunk_size=1, chunks=(), blocks=(sliced,), pre=sliced, post=sliced, batch_tokens=256
    )
    scaled = profile.with_sequence_scaled(2.0).blocks[0]
    assert scaled.act_bytes_keep == pytest.approx(longer.act_bytes_keep, rel=2e-3)
    assert scaled.mlp_act_bytes == pytest.approx(longer.mlp_act_bytes, rel=2e-3)
    assert scaled.act_bytes_checkpoint == 2 * sliced.act_bytes_checkpoint
    if attention == "eager":
        assert abs(2 * sliced.act_bytes_keep - longer.act_bytes_keep) > 0.01 * longer.act_bytes_keep


def test_probe_slices_fit_the_budget_share():
    x = torch.zeros(1, 65536, 64)
    per_position = 64 * 4
    budget = 32 * per_position * 4096 * 4  # PROBE_BUDGET_SHARE: a quarter holds 4096 positions
    assert probe.probe_slices((x,), 65536 * per_position, budget) == (65536, (1024, 2048, 4096))
    assert probe.probe_slices((x,), 65536 * per_position, None) is None
    assert probe.probe_slices((torch.zeros(4, 64),), 1, budget) is None
    # Never more than half the batch.
    assert probe.probe_slices((x,), 65536 * per_position, 1 << 50) == (
        65536,
        (8192, 16384, 32768),
    )


def test_extrapolate_fits_constant_linear_and_quadratic_terms():
    def fields(t: int, curve: float) -> dict:
        return {
            "act_bytes_keep": 7 + 3 * t + 2 * t * t,
            "fwd_s": 0.01 + 0.5 * t - curve * t * t,
            "bwd_transient_bytes": -5,
        }

    out = probe.extrapolate([(t, fields(t, 0.0)) for t in (16, 32, 64)], 1024)
    assert out["act_bytes_keep"] == 7 + 3 * 1024 + 2 * 1024 * 1024
    assert out["fwd_s"] == pytest.approx(0.01 + 0.5 * 1024)
    assert out["bwd_transient_bytes"] == -5
    # Negative curvature (noise): the line through the two longer slices instead.
    bent = probe.extrapolate([(t, fields(t, 1e-4)) for t in (16, 32, 64)], 1024)
    slope = (fields(64, 1e-4)["fwd_s"] - fields(32, 1e-4)["fwd_s"]) / 32
    assert bent["fwd_s"] == pytest.approx(fields(64, 1e-4)["fwd_s"] + slope * (1024 - 64))


@pytest.mark.parametrize("saved", ["linear", "quadratic"])
def test_a_peak_bends_up_past_the_slices_only_with_the_saved_bytes(saved: str) -> None:
    """A peak that moves from a constant part of the block (the smallest slice) to a linear one
    (the longer two) reads as a parabola through three slices: with saved bytes linear in the
    positions (flash attention), the line through the two longer slices is extrapolated; with
    saved bytes that grow quadratically (eager attention's probabilities), the parabola.
    Times keep their quadratic term (attention's compute)."""
    curve = 0 if saved == "linear" else 2

    def fields(t: int) -> dict:
        return {
            "act_bytes_keep": 100 * t + curve * t * t,
            "tiled_bwd_peak_bytes": max(5000, 200 * t),
            "bwd_s": 0.5 * t + 1e-3 * t * t,
        }

    measured = [(t, fields(t)) for t in (16, 32, 64)]
    out = probe.extrapolate(measured, 1024)
    a, b, c = probe._quadratic_through([16, 32, 64], [5000, 6400, 12800])
    if saved == "linear":
        assert out["tiled_bwd_peak_bytes"] == 200 * 1024  # the line through 6400 and 12800
    else:
        assert out["tiled_bwd_peak_bytes"] == int(a + b * 1024 + c * 1024 * 1024)
        assert out["tiled_bwd_peak_bytes"] > 2 * 200 * 1024
    assert out["act_bytes_keep"] == 100 * 1024 + curve * 1024 * 1024
    assert out["bwd_s"] == pytest.approx(0.5 * 1024 + 1e-3 * 1024 * 1024)


def test_blocks_of_one_class_with_other_parameters_are_probed_apart(
    make_llama, offload_cpu, make_batches
):
    """One class, two shapes (DeepSeek's dense first layers and MoE later ones, T5's encoder and
    decoder blocks, a ResNet's stages): each kind is probed on its own first block, and every
    block takes its kind's measurements (the first block's were given to all of them)."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    model = make_llama(n_layers=4)
    wide = type(model.config)(**{**model.config.to_dict(), "intermediate_size": 4 * 64})
    for layer in model.model.layers[2:]:
        layer.mlp = LlamaMLP(wide)
    offload_cpu()
    model.to("cpu")
    runtime = rt.runtime_of(model)
    seen: dict[int, int] = {i: 0 for i in range(4)}
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(
            lambda module, args, i=i: seen.__setitem__(i, seen[i] + runtime.step_state.hooks_muted)
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for ids in make_batches(4):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    from autooffload.runtime.control.probe import PROBE_RUNS

    assert seen == {0: PROBE_RUNS, 1: 0, 2: PROBE_RUNS, 3: 0}
    blocks = runtime.profile.blocks
    assert blocks[2].mlp_act_bytes > blocks[0].mlp_act_bytes
    assert blocks[1].mlp_act_bytes == blocks[0].mlp_act_bytes
    assert blocks[3].mlp_act_bytes == blocks[2].mlp_act_bytes
