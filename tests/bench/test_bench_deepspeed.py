"""The DeepSpeed peers: their engine configs, the sweep's order and pruning, and its report row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autooffload.bench import report, runner
from autooffload.bench.__main__ import main
from autooffload.bench.deepspeed_configs import (
    DEVICE_OOM,
    FITS,
    HOST_OOM,
    SWEEP,
    DeepSpeedConfig,
    DeepSpeedOptionError,
    gpu_need,
    host_need,
    label,
    skip_reason,
    sweep_order,
)
from autooffload.bench.runner import CommonSettings, PeerSpec, host_check, parse_peers, plan_runs
from autooffload.bench.table import format_table
from autooffload.bench.workloads import get_workload
from autooffload.runtime.chunks.host import HostMemory

GiB = 1 << 30
Z2_NO_GC, Z2_GC, Z3_LARGE_NO_GC, Z3_LARGE_GC, Z3_DEFAULT_GC, Z3_SMALL_GC, Z3_SMALL_UNPINNED = SWEEP


def test_stage_2_offloads_the_optimizer_only_and_stage_3_the_weights_too() -> None:
    z2 = DeepSpeedConfig(stage=2, pin=False).engine_config(bs=4, accum=2, lr=1e-3, bf16=True)
    zero = z2["zero_optimization"]
    assert zero["stage"] == 2 and "offload_param" not in zero
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert not any(key.startswith("stage3_") for key in zero)
    assert z2["gradient_accumulation_steps"] == 2 and z2["train_micro_batch_size_per_gpu"] == 4
    assert z2["optimizer"] == {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}}
    assert z2["bf16"] == {"enabled": True}
    # DeepSpeed clips the global gradient norm at 1.0 unless told; no other peer clips.
    assert z2["gradient_clipping"] == 0.0

    z3 = Z3_SMALL_GC.engine_config(bs=4, accum=1, lr=1e-4, bf16=False)["zero_optimization"]
    assert z3["stage"] == 3
    assert z3["offload_param"] == z3["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert z3["stage3_max_live_parameters"] == Z3_SMALL_GC.live == 10**8
    assert z3["stage3_prefetch_bucket_size"] == 10**7
    assert z3["stage3_param_persistence_threshold"] == 10**4
    assert z3["reduce_bucket_size"] == 5 * 10**7


def test_options_are_checked_and_command_line_floats_become_counts() -> None:
    config = DeepSpeedConfig.from_options({"stage": 3, "live": 1e9, "gc": False})
    assert config.live == 10**9 and isinstance(config.live, int)
    assert DeepSpeedConfig.from_options(config.options()) == config
    with pytest.raises(DeepSpeedOptionError, match="valid: bucket, clip, gc, live, masters"):
        DeepSpeedConfig.from_options({"stage3_max_live_parameters": 1})
    with pytest.raises(DeepSpeedOptionError, match="stage=1"):
        DeepSpeedConfig(stage=1)
    with pytest.raises(DeepSpeedOptionError, match="masters=fp32 or masters=bf16"):
        DeepSpeedConfig(masters="fp16")
    with pytest.raises(DeepSpeedOptionError, match="clip=-1"):
        DeepSpeedConfig(clip=-1)
    with pytest.raises(ValueError, match="unknown deepspeed option"):
        parse_peers("deepspeed[offload=nvme]")


def test_the_workloads_gc_applies_unless_the_configuration_names_one() -> None:
    assert DeepSpeedConfig().with_gc(True).gc is True
    assert DeepSpeedConfig(gc=False).with_gc(True).gc is False


def test_the_sweep_runs_fastest_first() -> None:
    """No configuration is at least as fast as (and as large as) one tried before it: else the
    earlier one's success would never let the pruning skip it."""
    for i, earlier in enumerate(SWEEP):
        for later in SWEEP[i + 1 :]:
            assert not later.at_least_as_fast_as(earlier), (earlier, later)
    assert Z2_NO_GC.at_least_as_fast_as(Z3_SMALL_UNPINNED)


def test_a_fitting_configuration_skips_every_slower_one() -> None:
    done = [(Z2_GC, FITS)]
    for slower in (Z3_LARGE_GC, Z3_DEFAULT_GC, Z3_SMALL_GC, Z3_SMALL_UNPINNED):
        assert "no faster than [stage=2,gc=True], which fits" == skip_reason(slower, done)
    # Keeping activations at stage 3 may beat recomputing them at stage 2: it still runs.
    assert skip_reason(Z3_LARGE_NO_GC, done) is None
    assert skip_reason(Z3_SMALL_UNPINNED, [(Z3_SMALL_GC, FITS)]) is not None
    assert skip_reason(Z3_SMALL_GC, [(Z3_SMALL_UNPINNED, FITS)]) is None  # pinned: faster


def test_an_oom_skips_every_configuration_that_needs_as_much() -> None:
    done = [(Z2_NO_GC, DEVICE_OOM)]
    assert skip_reason(Z2_GC, done) is None  # checkpointing frees the activations
    assert skip_reason(Z3_LARGE_NO_GC, done) is None  # weights offloaded
    done = [(Z3_SMALL_GC, DEVICE_OOM)]
    reason = skip_reason(Z3_SMALL_UNPINNED, done)
    assert reason and "ran out of it" in reason  # pinning changes host memory only
    for larger in (Z3_DEFAULT_GC, Z3_LARGE_GC, Z3_LARGE_NO_GC, Z2_GC, Z2_NO_GC):
        assert skip_reason(larger, done) is not None, larger
    # A failure that is not a memory shortage tells nothing about the others.
    assert skip_reason(Z3_SMALL_UNPINNED, [(Z3_SMALL_GC, "failed")]) is None


def test_a_host_oom_ends_the_sweep() -> None:
    reason = skip_reason(Z3_SMALL_UNPINNED, [(Z2_NO_GC, HOST_OOM)])
    assert reason and "host ran out of memory" in reason


def test_the_sweep_expands_into_runs_unless_options_fix_a_configuration() -> None:
    workload = get_workload("llama-tiny")
    runs = plan_runs([workload], [8 * GiB], parse_peers("vanilla,deepspeed,deepspeed[stage=2]"), 1)
    sweep = [r for r in runs if r.sweep == "deepspeed"]
    assert [DeepSpeedConfig.from_options(r.peer.options) for r in sweep] == list(SWEEP)
    assert [r.peer.label for r in runs if r.sweep is None] == ["vanilla", "deepspeed[stage=2]"]


def test_autooffload_settings_do_not_reach_the_deepspeed_peers() -> None:
    specs = parse_peers("autooffload,deepspeed_offload,deepspeed_zero2", {"n_persist": 4})
    assert [s.options for s in specs] == [{"n_persist": 4}, {}, {}]
    assert specs[0] == PeerSpec("autooffload", {"n_persist": 4})


def test_the_sweep_runs_on_cpu_and_reports_its_best_configuration(tmp_path: Path, capsys) -> None:
    """The simulated DeepSpeed peer runs out of memory at stage 2 and without checkpointing: the
    sweep runs until the fastest configuration that fits, skips the rest with the reason, and
    the report's row names that configuration and the ones that ran out of memory."""
    out = tmp_path / "sweep.json"
    argv = ["--workload", "llama-tiny", "--device", "cpu", "--peers", "vanilla,_deepspeed_sim"]
    assert main([*argv, "--steps", "2", "--warmup", "1", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    sweep = [r for r in payload["runs"] if r["sweep"] == "_deepspeed_sim"]
    statuses = [r["status"] for r in sweep]
    assert statuses == ["OOM", "OOM", "OOM", "ok", "skipped", "skipped", "skipped"]
    assert all("not run: no faster than [stage=3,gc=True" in r["reason"] for r in sweep[4:])
    best = next(r for r in payload["summary"] if r.get("sweep_best"))
    large_gc = "stage=3,gc=True,live=2000000000,prefetch=200000000,persist=1000000"
    assert best["config"] == large_gc
    assert best["configs_oom"] == [
        "stage=2,gc=False",
        "stage=2,gc=True",
        "stage=3,gc=False,live=2000000000,prefetch=200000000,persist=1000000",
    ]
    assert best["tokens_per_s"] == sweep[3]["tokens_per_s"] and best["loss_check"] == "ok"
    table = capsys.readouterr().out
    assert f"| llama-tiny | none | _deepspeed_sim [{large_gc}] | ok |" in table
    assert f"- [{large_gc}] (best): " in table
    assert table.count("| _deepspeed_sim") == 1  # the configurations are listed under the table


def _config_run(config: str, cap: str, status: str, tps: float | None, reserved: float) -> dict:
    ok = status == "ok"
    return {
        "workload": "w",
        "peer": "deepspeed",
        "peer_label": f"deepspeed[{config}]",
        "sweep": "deepspeed",
        "cap": cap,
        "status": status,
        "message": None if ok else "OutOfMemoryError: CUDA out of memory",
        "reason": None if ok else "OutOfMemoryError: CUDA out of memory",
        "tokens_per_s": tps,
        "step_s_median": 1 / tps if tps else None,
        "peak_allocated_gib": reserved - 1 if ok else None,
        "peak_reserved_gib": reserved if ok else None,
        "host_rss_peak_gib": 50.0,
        "loss_first": 10.0 if ok else None,
        "loss_final": 8.0 if ok else None,
    }


def test_where_no_configuration_fits_the_row_says_so_with_the_memory_it_needs() -> None:
    results = [
        _config_run("stage=2,gc=True", "8GiB", "OOM", None, 0),
        _config_run("stage=3,gc=True", "8GiB", "OOM", None, 0),
        _config_run("stage=2,gc=True", "16GiB", "OOM", None, 0),
        _config_run("stage=3,gc=True", "16GiB", "ok", 900.0, 11.5),
        _config_run("stage=2,gc=True", "24GiB", "ok", 2000.0, 19.0),
        _config_run("stage=3,gc=True", "24GiB", "ok", 950.0, 11.6),
        {
            **_config_run("x", "8GiB", "ok", 4000.0, 7.5),
            **{"peer": "autooffload", "peer_label": "autooffload", "sweep": None},
        },
    ]
    rows = report.summarise(results)
    best = {r["cap"]: r for r in rows if r.get("sweep_best")}
    assert best["8GiB"]["status"] == "OOM" and best["8GiB"]["tokens_per_s"] is None
    assert best["8GiB"]["need_gib"] == 11.5 and best["8GiB"]["need_cap"] == "16GiB"
    assert best["8GiB"]["message"] == (
        "no configuration fits 8GiB; needs 11.5 GiB ([stage=3,gc=True] at cap 16GiB)"
    )
    assert best["16GiB"]["config"] == "stage=3,gc=True"
    assert best["16GiB"]["configs_oom"] == ["stage=2,gc=True"]
    assert best["24GiB"]["config"] == "stage=2,gc=True" and best["24GiB"]["tokens_per_s"] == 2000
    table = format_table(rows)
    assert "| w | 8GiB | deepspeed | OOM |" in table
    assert "- autooffload: runs; no configuration fits 8GiB; needs 11.5 GiB" in table


def test_clipping_and_bf16_masters_are_options_for_the_loss_comparison() -> None:
    config = DeepSpeedConfig.from_options({"stage": 2, "clip": 1.0, "masters": "bf16"})
    engine = config.engine_config(bs=4, accum=1, lr=1e-3, bf16=True)
    assert engine["gradient_clipping"] == 1.0
    assert engine["bf16"] == {
        "enabled": True,
        "bf16_master_weights_and_grads": True,
        "bf16_optimizer_states": True,
    }
    assert label(config) == "stage=2,clip=1.0,masters=bf16"
    # zero_init is a stage-3 knob: not in a stage-2 label.
    assert label(DeepSpeedConfig(stage=2, zero_init=False)) == "stage=2"
    assert label(DeepSpeedConfig(zero_init=False)) == "stage=3,zero_init=False"


def test_stage_3_without_zero_init_needs_the_whole_model_on_the_gpu_first() -> None:
    with_init = DeepSpeedConfig(gc=True)
    without = DeepSpeedConfig(gc=True, zero_init=False)
    assert without.needs_at_least_the_memory_of(with_init)
    assert not with_init.needs_at_least_the_memory_of(without)
    workload = get_workload("llama-8b-lora")
    assert gpu_need(without, workload) > 15 * GiB > gpu_need(with_init, workload)


# Host RSS peaks recorded on the H100 host (benchmarks/results/2026-11-28-h100-*-deepspeed.json).
RECORDED_HOST_GIB = [
    ("llama-1b-full", Z2_GC, 31.36),
    ("llama-3.6b-full", Z3_LARGE_GC, 84.25),
]


@pytest.mark.parametrize(("name", "config", "measured"), RECORDED_HOST_GIB)
def test_the_host_estimate_covers_the_recorded_peaks_closely(
    name: str, config: DeepSpeedConfig, measured: float
) -> None:
    need = host_need(config, get_workload(name))
    assert need is not None and need.ranks == 1
    assert measured <= need.total / GiB <= measured * 1.06
    assert need.total == sum(need.parts.values())


def test_the_host_estimate_counts_pinned_rounding_and_every_rank_on_the_host() -> None:
    workload = get_workload("llama-8b-full")
    one = host_need(Z3_LARGE_GC, workload)
    two = host_need(Z3_LARGE_GC, workload, ranks=2)
    assert one is not None and two is not None
    assert two.total == 2 * two.per_rank and two.per_rank < one.per_rank < two.total
    # torch's pinned allocator rounds each block up to a power of two.
    pinned = one.parts["gradient partition (pinned)"]
    assert pinned == 1 << 35 and pinned > 4 * 8_030_261_248
    unpinned = host_need(Z3_SMALL_UNPINNED, workload)
    assert unpinned is not None and unpinned.total < one.total
    # 8B full fine-tuning does not fit a 125 GiB host in any configuration.
    assert all(host_need(c.with_gc(True), workload).total > 125 * GiB for c in SWEEP)


def test_lora_keeps_the_frozen_base_on_the_gpu_at_stage_2_and_on_the_host_at_stage_3() -> None:
    workload = get_workload("llama-8b-lora")
    z2, z3 = host_need(Z2_GC, workload), host_need(Z3_DEFAULT_GC, workload)
    assert z2 is not None and z3 is not None
    base_bf16 = 2 * 8_030_261_248
    assert z3.parts["frozen partitions (pinned)"] >= base_bf16
    assert "frozen partitions (pinned)" not in z2.parts
    assert z2.parts["AdamW state"] == 8 * 41_943_040  # the adapters' fp32 moments
    assert host_need(Z2_GC, get_workload("qwen2vl-tiny-lora")) is None


def test_the_sweep_tries_first_the_configurations_likely_to_fit_the_cap() -> None:
    """Recorded at 3.6B / 16 GiB: stage 2 without checkpointing and stage 3 keeping activations
    ran out of memory, stage 3 large with checkpointing fit; at 8B / 24 GiB stage 2 holds 15 GiB
    of weights alone and goes last."""
    workload = get_workload("llama-3.6b-full")
    need = {c: gpu_need(c, workload) for c in (Z2_NO_GC, Z3_LARGE_NO_GC, Z3_LARGE_GC)}
    assert need[Z2_NO_GC] > 16 * GiB and need[Z3_LARGE_NO_GC] > 16 * GiB
    assert need[Z3_LARGE_GC] <= 16 * GiB
    order = sweep_order(SWEEP, get_workload("llama-8b-full"), 24 * GiB)
    assert order == [
        *(Z3_LARGE_GC, Z3_DEFAULT_GC, Z3_SMALL_GC, Z3_SMALL_UNPINNED),  # fastest first
        *(Z2_GC, Z3_LARGE_NO_GC, Z2_NO_GC),  # least need first
    ]
    assert sweep_order(SWEEP, workload, None) == list(SWEEP)
    # Where nothing is expected to fit, the first one's OOM rules out every other.
    lora = sweep_order(SWEEP, get_workload("llama-8b-lora"), 6 * GiB)
    assert all(skip_reason(c, [(lora[0], DEVICE_OOM)]) for c in lora[1:])
    runs = plan_runs([get_workload("llama-8b-full")], [24 * GiB], parse_peers("deepspeed"), 1)
    assert [DeepSpeedConfig.from_options(r.peer.options) for r in runs] == order


def _host_sweep(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "host.json"
    argv = ["--workload", "llama-tiny", "--device", "cpu", "--peers", "vanilla,_deepspeed_sim"]
    assert main([*argv, "--steps", "1", "--warmup", "1", "--out", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_a_configuration_the_host_cannot_hold_is_not_started(tmp_path: Path, capsys) -> None:
    payload = _host_sweep(tmp_path, "--host-memory", "512MiB")
    sweep = [r for r in payload["runs"] if r["sweep"] == "_deepspeed_sim"]
    assert {r["status"] for r in sweep} == {"skipped"}
    need = host_need(SWEEP[0], get_workload("llama-tiny"))
    assert need is not None
    reason = f"host memory: needs ~{need.total / GiB:.1f} GiB, the host has 0.5 GiB available"
    assert sweep[0]["reason"] == reason
    assert sweep[0]["host_need_gib"] == pytest.approx(need.total / GiB)
    assert sweep[0]["host_available_gib"] == 0.5
    best = next(r for r in payload["summary"] if r.get("sweep_best"))
    assert best["status"] == "skipped" and best["message"].startswith("host memory: needs ~")
    assert len(best["configs_host_memory"]) == len(SWEEP)
    table = capsys.readouterr().out
    assert "| llama-tiny | none | _deepspeed_sim | skipped: host memory: needs ~" in table
    assert "the host has 0.5 GiB available" in table
    # The vanilla peer has no estimate and runs.
    assert next(r for r in payload["runs"] if r["peer"] == "vanilla")["status"] == "ok"


def test_the_available_memory_is_read_before_each_run(tmp_path: Path, monkeypatch) -> None:
    available = {"bytes": 100 * GiB}
    monkeypatch.setattr(
        runner,
        "host_memory",
        lambda: HostMemory(128 * GiB, available["bytes"], cgroup_limited=False),
    )
    common = CommonSettings("cpu", steps=1, warmup=1)
    runs = plan_runs([get_workload("llama-3.6b-full")], [None], parse_peers("deepspeed"), 1)
    run = next(r for r in runs if r.peer.options == Z3_LARGE_GC.options())
    fields, reason = host_check(run, common)
    assert reason is None and fields["host_available_gib"] == 100
    available["bytes"] = 80 * GiB  # the 3.6B stage-3 run needs ~88 GiB
    fields, reason = host_check(run, common)
    assert reason == "host memory: needs ~88 GiB, the host has 80 GiB available"
    two = plan_runs([get_workload("llama-3b-full")], [None], parse_peers("deepspeed"), 1, None, [2])
    available["bytes"] = 50 * GiB
    _, reason = host_check(two[0], common)  # stage 2: ~40 GiB a rank
    assert reason == "host memory: needs ~80 GiB (2 ranks x 40), the host has 50 GiB available"
    common.check_host_memory = False  # --host-memory none
    fields, reason = host_check(run, common)
    assert reason is None and "host_available_gib" not in fields and fields["host_need_gib"] > 80


def test_a_configuration_that_fits_the_host_runs_with_its_estimate_beside_its_rss(
    tmp_path: Path, capsys
) -> None:
    payload = _host_sweep(tmp_path, "--host-memory", "64GiB")
    ran = [r for r in payload["runs"] if r["sweep"] and r["status"] == "ok"]
    assert ran and all(r["host_need_gib"] > 1 for r in ran)
    assert ran[0]["host_rss_total_gib"] == ran[0]["host_rss_peak_gib"]
    assert " (est " in capsys.readouterr().out
