"""Host memory: the runtime checks host RAM (the container's cgroup limit included) and
``AUTOOFFLOAD_HOST_BUDGET`` before it allocates anything, and a failed pinned allocation falls
back to pageable memory with one warning instead of failing."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
from _faults import assert_same_weights, batches, enable_cpu, tiny_llama, weights

import autooffload
from autooffload import runtime as rt
from autooffload.errors import PlanError
from autooffload.runtime.chunks.host import HostArena, HostMemory, host_memory
from autooffload.runtime.control import host_need

GIB = 1 << 30


def _fake_host(tmp_path: Path, total: int, available: int, cgroup: dict[str, str]) -> Path:
    (tmp_path / "meminfo").write_text(
        f"MemTotal:       {total // 1024} kB\nMemFree:        1 kB\n"
        f"MemAvailable:   {available // 1024} kB\n"
    )
    root = tmp_path / "cgroup"
    for name, text in cgroup.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    root.mkdir(exist_ok=True)
    return root


@pytest.mark.parametrize(
    ("cgroup", "expected"),
    [
        ({}, HostMemory(16 * GIB, 10 * GIB, False)),
        ({"memory.max": "max", "memory.current": "123"}, HostMemory(16 * GIB, 10 * GIB, False)),
        (
            {"memory.max": str(4 * GIB), "memory.current": str(3 * GIB)},
            HostMemory(4 * GIB, 1 * GIB, True),
        ),
        (
            {
                "memory/memory.limit_in_bytes": str(8 * GIB),
                "memory/memory.usage_in_bytes": str(2 * GIB),
            },
            HostMemory(8 * GIB, 6 * GIB, True),
        ),
        (
            {"memory/memory.limit_in_bytes": "9223372036854771712"},
            HostMemory(16 * GIB, 10 * GIB, False),
        ),
    ],
    ids=["no-cgroup", "v2-unlimited", "v2-limit", "v1-limit", "v1-unlimited"],
)
def test_host_memory_reads_the_cgroup_limit(tmp_path, cgroup, expected):
    root = _fake_host(tmp_path, 16 * GIB, 10 * GIB, cgroup)
    assert host_memory(tmp_path / "meminfo", root) == expected


def test_host_memory_unknown_without_proc(tmp_path):
    assert host_memory(tmp_path / "missing", tmp_path) is None


def test_host_memory_of_this_machine_is_sane():
    memory = host_memory()
    if memory is None:
        pytest.skip("no /proc/meminfo here")
    assert 0 < memory.available_bytes <= memory.total_bytes


@pytest.mark.parametrize("budget", [10_000, 1e-9], ids=["bytes", "fraction"])
def test_host_budget_too_small_fails_before_allocating(monkeypatch, budget):
    arenas = []
    monkeypatch.setattr(HostArena, "__init__", lambda self, *a, **k: arenas.append(a))
    model = tiny_llama()
    before = weights(model)
    enable_cpu(host_budget=budget)
    with pytest.raises(PlanError) as error:
        model.to("cpu")
    message = str(error.value)
    for needle in ("GiB of host memory", "AUTOOFFLOAD_HOST_BUDGET=", "AUTOOFFLOAD_N_PERSIST"):
        assert needle in message, message
    assert "AUTOOFFLOAD_MASTER_WEIGHTS" in message
    assert arenas == [], "host memory was allocated before the check"
    assert rt.runtimes() == []
    assert_same_weights(before, weights(model))


def test_container_limit_below_the_need_fails_naming_it(monkeypatch):
    small = HostMemory(total_bytes=1 << 20, available_bytes=0, cgroup_limited=True)
    monkeypatch.setattr(host_need, "host_memory", lambda: small)
    enable_cpu(n_persist=0)
    # The model's own CPU parameters count as available (the host store replaces them); the
    # store, gradient staging and optimizer state together need more.
    with pytest.raises(PlanError, match="container cgroup limit"):
        tiny_llama().to("cpu")
    assert rt.runtimes() == []


def _layout(model: torch.nn.Module, **settings):
    runtime = autooffload.attach(copy.deepcopy(model), device="cpu", n_persist=0, **settings)
    layout = runtime.layout
    rt.detach(runtime.model)
    return layout


def test_needed_bytes_count_masters_and_optimizer_state():
    layout = _layout(tiny_llama().to(torch.bfloat16))
    off = host_need.host_bytes_needed(layout, n_persist=0, master_weights=False)
    on = host_need.host_bytes_needed(layout, n_persist=0, master_weights=True)
    assert off["masters"] == 0 and on["masters"] > 0
    assert on["host grads + optimizer state"] == 2 * off["host grads + optimizer state"]
    all_persistent = host_need.host_bytes_needed(layout, len(layout.chunks), master_weights=True)
    assert all_persistent["masters"] == 0
    assert all_persistent["host store"] == off["host store"] == layout.total_bytes


def test_sharded_ranks_need_their_own_chunks_only_and_share_the_host():
    """Under sharded state a rank keeps the host bytes, staging, masters and optimizer state of
    the trainable chunks it owns; ranks on one host split its available memory."""
    model = tiny_llama().to(torch.bfloat16)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    layout = _layout(model, chunk_size=size // 4)
    assert len(layout.chunks) >= 3
    whole = host_need.host_bytes_needed(layout, n_persist=0, master_weights=True)
    halves = [
        host_need.host_bytes_needed(
            layout, n_persist=0, master_weights=True, hosts=lambda i, r=r: i % 2 == r
        )
        for r in range(2)
    ]
    for part in whole:
        assert halves[0][part] + halves[1][part] == whole[part]
        assert halves[0][part] < whole[part] or whole[part] == 0
    settings = autooffload.Settings(master_weights=True)
    need = sum(halves[0].values())
    enough = HostMemory(total_bytes=1 << 40, available_bytes=2 * need, cgroup_limited=False)
    host_need.check_host_memory(
        layout, 0, settings, memory=enough, hosts=lambda i: i % 2 == 0, local_ranks=2
    )
    # Two ranks each needing ``need``: short by one byte is refused, naming the sharing.
    short = HostMemory(total_bytes=1 << 40, available_bytes=2 * need - 2, cgroup_limited=False)
    with pytest.raises(PlanError, match="per rank .* shared by the 2 ranks on this host"):
        host_need.check_host_memory(
            layout, 0, settings, memory=short, hosts=lambda i: i % 2 == 0, local_ranks=2
        )


def test_generous_host_budget_attaches_and_trains():
    base = tiny_llama()
    plain = copy.deepcopy(base)
    model = copy.deepcopy(base)
    enable_cpu(n_persist=1, host_budget="1GiB")
    model.to("cpu")
    assert rt.runtime_of(model) is not None
    for m in (plain, model):
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
        for ids in batches(3):
            m(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        autooffload.disable()
    assert_same_weights(weights(plain), weights(model))


def _fail_pinning(monkeypatch: pytest.MonkeyPatch) -> None:
    empty = torch.empty

    def empty_without_pinning(*args, **kwargs):
        if kwargs.get("pin_memory"):
            raise RuntimeError("CUDA error: out of memory (injected pinning failure)")
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty_without_pinning)


def test_pinning_failure_falls_back_to_pageable_with_one_warning(monkeypatch):
    _fail_pinning(monkeypatch)
    with pytest.warns(UserWarning, match="pinning .* failed.*ulimit -l"):
        arena = HostArena([100, 200], pin=True)
    assert not arena.pinned
    arena.view(1).fill_(7)
    assert arena.view(1).sum().item() == 7 * 200 and arena.view(0).numel() == 100
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not HostArena([64], pin=True).pinned


@pytest.mark.gpu
def test_pinning_failure_on_gpu_still_trains_like_plain(monkeypatch):
    base = tiny_llama()
    plain = copy.deepcopy(base).cuda()
    _fail_pinning(monkeypatch)
    autooffload.enable(force_attach=True, n_persist=1, chunk_size=20_000, mask=False)
    model = copy.deepcopy(base)
    with pytest.warns(UserWarning, match="pinning"):
        model.cuda()
    runtime = rt.runtime_of(model)
    assert runtime is not None and not runtime.manager.host.pinned
    for m in (plain, model):
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for ids in batches(3):
            ids = ids.cuda()
            m(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    autooffload.disable()
    for (name, expected), actual in zip(weights(plain).items(), weights(model).values()):
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4, msg=name)
