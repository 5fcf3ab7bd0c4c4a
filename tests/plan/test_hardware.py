"""Hardware measurement and its per-machine cache."""

from __future__ import annotations

import json
import math

import pytest
import torch

from autooffload.plan import hardware
from autooffload.plan.hardware import cache_key, cache_path, measure_hardware
from autooffload.plan.profile_types import HardwareProfile


@pytest.fixture
def counted(monkeypatch):
    """Replace the slow measurements by counters (the cache logic is what is under test)."""
    calls = {"copies": 0}

    def fake_bandwidths(nbytes):
        calls["copies"] += 1
        return 1e10, 2e10, 2.5e10

    monkeypatch.setattr(hardware, "_host_bandwidths", fake_bandwidths)
    monkeypatch.setattr(hardware, "optimizer_rate", lambda cls, device, dtype: (1e9, "AdamW"))
    monkeypatch.delenv("AUTOOFFLOAD_REPROFILE", raising=False)
    return calls


def test_cpu_measurement_is_real_positive_and_finite(tmp_path):
    profile = measure_hardware("cpu", tmp_path, reprofile=True, copy_bytes=32 << 20)
    for name in ("h2d_bps", "d2h_bps", "duplex_bps", "cpu_optim_params_per_s"):
        value = getattr(profile, name)
        assert math.isfinite(value) and value > 0, name
    assert 0 < profile.gpu_free_bytes <= profile.gpu_total_bytes
    assert profile.device_type == "cpu" and profile.cuda_context_bytes == 0
    assert profile.optimizer_name.startswith("AdamW")
    assert profile.cpu_threads == torch.get_num_threads()
    print(f"\nCPU profile measured in {profile.measure_s:.2f} s: {profile}")


def test_optimizer_rate_depends_on_the_work_per_step():
    fast, name = hardware.optimizer_rate(
        torch.optim.SGD, torch.device("cpu"), torch.float32, numel=1 << 20, seconds=0.05
    )
    assert name.startswith("SGD") and fast > 0


def test_second_call_reads_the_cache_and_refreshes_free_memory(tmp_path, counted, monkeypatch):
    first = measure_hardware("cpu", tmp_path)
    monkeypatch.setattr(hardware, "_memory", lambda device: (123, 456))
    second = measure_hardware("cpu", tmp_path)
    assert counted["copies"] == 1
    assert second.h2d_bps == first.h2d_bps == 1e10
    assert (second.gpu_free_bytes, second.gpu_total_bytes) == (123, 456)
    files = list(tmp_path.iterdir())
    assert [f.name for f in files] == [
        cache_path(tmp_path, cache_key(torch.device("cpu"), torch.optim.AdamW)).name
    ]


def test_reprofile_flag_and_env_force_a_new_measurement(tmp_path, counted, monkeypatch):
    measure_hardware("cpu", tmp_path)
    measure_hardware("cpu", tmp_path, reprofile=True)
    monkeypatch.setenv("AUTOOFFLOAD_REPROFILE", "1")
    measure_hardware("cpu", tmp_path)
    assert counted["copies"] == 3


def test_corrupted_cache_is_ignored_and_rewritten(tmp_path, counted):
    path = cache_path(tmp_path, cache_key(torch.device("cpu"), torch.optim.AdamW))
    path.write_text('{"key": {"version": 1}, "profile": {"h2d_bps": ')
    profile = measure_hardware("cpu", tmp_path)
    assert counted["copies"] == 1 and profile.h2d_bps == 1e10
    stored = json.loads(path.read_text())
    assert HardwareProfile.from_dict(stored["profile"]).h2d_bps == 1e10
    path.write_text(json.dumps({"key": stored["key"], "profile": {"h2d_bps": 1}}))
    measure_hardware("cpu", tmp_path)
    assert counted["copies"] == 2
    assert not [f for f in tmp_path.iterdir() if f.suffix == ".tmp"]


def test_cache_is_keyed_by_optimizer_and_threads(tmp_path, counted, monkeypatch):
    measure_hardware("cpu", tmp_path)
    measure_hardware("cpu", tmp_path, optimizer_cls=torch.optim.Adam)
    assert counted["copies"] == 2
    monkeypatch.setattr(torch, "get_num_threads", lambda: 999)
    measure_hardware("cpu", tmp_path)
    assert counted["copies"] == 3
    assert len(list(tmp_path.glob("hardware-*.json"))) == 3


def test_ranks_sharing_a_host_are_cached_apart_and_probe_after_the_barrier(
    tmp_path, counted, monkeypatch
):
    order = []
    monkeypatch.setattr(
        hardware, "_host_bandwidths", lambda nbytes: order.append("copies") or (1e10, 2e10, 3e10)
    )
    monkeypatch.setattr(
        hardware, "optimizer_rate", lambda cls, device, dtype: order.append("optim") or (1e9, "x")
    )
    measure_hardware("cpu", tmp_path, local_ranks=4, barrier=lambda: order.append("barrier"))
    # Every probe starts right after a barrier: all ranks of the host copy and update at once.
    assert order[:4] == ["barrier", "copies", "barrier", "optim"]
    assert hardware.cached_hardware("cpu", tmp_path, torch.optim.AdamW, local_ranks=4)
    assert hardware.cached_hardware("cpu", tmp_path, torch.optim.AdamW, local_ranks=1) is None
    measure_hardware("cpu", tmp_path, local_ranks=4, barrier=lambda: order.append("barrier"))
    assert order.count("copies") == 1  # the second call read the cache: no barrier either
    assert order.count("barrier") == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_measurement_is_plausible(tmp_path):
    # Its duration is printed, not asserted (no test asserts on wall time): 1.0-1.1 s on the
    # H100 machine once torch._dynamo is imported (a fresh process's first torch.optim
    # constructor, 1-4 s, which the runtime's measurement never pays: the script built its
    # optimizer before the first profiling step).
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    profile = measure_hardware("cuda", tmp_path, reprofile=True)
    print(f"\nCUDA profile measured in {profile.measure_s:.2f} s: {profile}")
    assert profile.measure_s > 0
    assert 1e9 < profile.h2d_bps < 1e12 and 1e9 < profile.d2h_bps < 1e12
    assert profile.duplex_bps >= 0.9 * max(profile.h2d_bps, profile.d2h_bps)
    assert 0 < profile.cuda_context_bytes < 4 << 30
    assert profile.gpu_optim_params_per_s > profile.cpu_optim_params_per_s


def test_optimizer_rate_measures_on_less_when_the_first_size_runs_out_of_memory(monkeypatch):
    real_zeros = torch.zeros
    sizes = []

    def capped_zeros(numel, **kwargs):
        sizes.append(numel)
        if numel > 1 << 21:
            raise torch.OutOfMemoryError("per-process cap")
        return real_zeros(numel, **kwargs)

    monkeypatch.setattr(hardware.torch, "zeros", capped_zeros)
    monkeypatch.setattr(hardware.torch.cuda, "empty_cache", lambda: None)
    rate, _ = hardware.optimizer_rate(
        torch.optim.SGD, torch.device("cpu"), torch.float32, numel=1 << 24, seconds=0.01
    )
    assert rate > 0 and sizes == [1 << 24, 1 << 22, 1 << 20]
