"""The activation peers: HF gc, save_on_cpu and autooffload with one activation policy forced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from autooffload.bench.__main__ import main
from autooffload.bench.models import _config, base_model, make_batch
from autooffload.bench.peers import PEERS, PeerContext, public_peers
from autooffload.bench.workloads import get_workload
from autooffload.settings import current

ACTIVATION_PEERS = (
    "hf_gc",
    "save_on_cpu",
    "autooffload_keep",
    "autooffload_ckpt",
    "autooffload_swap",
)


def context(workload_name: str = "llama-tiny-lora", **options) -> PeerContext:
    return PeerContext(get_workload(workload_name), "cpu", None, seed=0, options=options)


def test_activation_peers_are_listed() -> None:
    assert set(ACTIVATION_PEERS) <= set(public_peers())


@pytest.mark.parametrize("name", ["llama-8b-lora", "llama-1b-full"])
@pytest.mark.parametrize("seq", [8192, 16384])
def test_long_seq_overrides_reach_the_model_config(name: str, seq: int) -> None:
    workload = get_workload(name, bs=1, seq=seq, gc=False)
    assert (workload.bs, workload.seq, workload.gc) == (1, seq, False)
    assert _config(workload).max_position_embeddings >= seq
    assert workload.tokens_per_step == seq


def test_hf_gc_checkpoints_whatever_the_workload_says() -> None:
    trainee = PEERS["hf_gc"].setup(context("llama-tiny"))  # llama-tiny has gc=False
    assert base_model(trainee.model).is_gradient_checkpointing


def test_save_on_cpu_steps_inside_save_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    entered: list[bool] = []
    real = torch.autograd.graph.save_on_cpu

    class Counting(real):
        def __init__(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
            entered.append(pin_memory)
            super().__init__(pin_memory=pin_memory, device_type=device_type)

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Counting)
    trainee = PEERS["save_on_cpu"].setup(context())  # llama-tiny-lora has gc=True
    assert not base_model(trainee.model).is_gradient_checkpointing
    loss = trainee.step(make_batch(get_workload("llama-tiny-lora")))
    assert entered == [False] and loss.isfinite()  # no pinning without an accelerator


def test_save_on_cpu_at_a_length_no_host_holds_is_skipped_before_it_starts() -> None:
    """save_on_cpu pins every saved tensor: the runner skips a length whose lower bound is over
    the host's available memory (the host would kill it, or its neighbours), and runs the
    lengths that fit, the estimate beside."""
    from dataclasses import replace

    from autooffload.bench.runner import CommonSettings, host_check, parse_peers, plan_runs

    GiB = 1 << 30
    w = replace(get_workload("llama-8b-lora"), bs=1)
    runs = plan_runs([w], [None], parse_peers("save_on_cpu"), 1, seqs=[8192, 32768])
    common = CommonSettings("cuda", steps=1, warmup=1, host_memory_bytes=120 * GiB)
    (short, _), (long, reason) = (host_check(run, common) for run in runs)
    assert host_check(runs[0], common)[1] is None
    # 43 GiB of layers' tensors, 38 of LoRA's fp32 input copies, 4 of fp32 log-softmax.
    parts = short["host_need_parts_gib"]
    assert 42.5 < parts["saved activations"] < 43.5
    assert 37.5 < parts["LoRA inputs' fp32 copies"] < 38.5
    assert 3.5 < parts["logits (fp32 log-softmax)"] < 4.5
    assert 84 < short["host_need_gib"] < 86
    assert long["host_need_gib"] > 4 * short["host_need_gib"] - 1
    assert reason == "host memory: needs ~340 GiB, the host has 120 GiB available"
    # Full fine-tuning: no adapters, no copies.
    full = replace(get_workload("llama-8b-full"), bs=1, seq=8192)
    (full_run,) = plan_runs([full], [None], parse_peers("save_on_cpu"), 1)
    assert "LoRA inputs' fp32 copies" not in host_check(full_run, common)[0]["host_need_parts_gib"]


@pytest.mark.parametrize(
    ("peer", "mode"),
    [
        ("autooffload_keep", "keep"),
        ("autooffload_ckpt", "checkpoint"),
        ("autooffload_swap", "swap"),
    ],
)
def test_fixed_mode_peers_force_activation_mode_only(peer: str, mode: str) -> None:
    trainee = PEERS[peer].setup(context(n_buffer=2))
    try:
        settings = current()
        assert settings is not None
        assert settings.activation_mode == mode
        assert settings.n_buffer == 2 and settings.n_persist is None  # the rest is planned
    finally:
        trainee.close()
    assert current() is None


def test_bench_runs_every_activation_peer_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "activations.json"
    argv = ["--workload", "llama-tiny-lora", "--device", "cpu", "--no-gc"]
    argv += ["--peers", ",".join(("vanilla", *ACTIVATION_PEERS))]
    argv += ["--steps", "2", "--warmup", "1", "--out", str(out)]
    assert main(argv) == 0
    runs = {r["peer_label"]: r for r in json.loads(out.read_text())["runs"]}
    for label in ("vanilla", *ACTIVATION_PEERS):
        assert runs[label]["status"] == "ok", (label, runs[label].get("reason"))
        assert runs[label]["loss_check"] == "ok", (label, runs[label].get("loss_vs_vanilla"))
        assert runs[label]["seq"] == 32
    for label in ("autooffload_keep", "autooffload_ckpt", "autooffload_swap"):
        assert runs[label]["attached"] is True, label
