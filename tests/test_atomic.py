"""Every file autooffload writes (hardware cache, bench results and specs, plots) is written to
a temporary file and renamed: a failure mid-write leaves the old file intact and no temp file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from autooffload.atomic import atomic_write, write_text_atomic
from autooffload.bench import plots, report
from autooffload.plan import hardware
from autooffload.plan.profile_types import HardwareProfile

OLD = '{"old": true}'


class DiskFull(OSError):
    """The disk filling up between writing the bytes and making them durable."""


@pytest.fixture
def failing_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    def fsync(fd: int) -> None:
        raise DiskFull(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fsync)


def only_the_old_file(path: Path) -> bool:
    return path.read_text() == OLD and [p.name for p in path.parent.iterdir()] == [path.name]


def test_success_replaces_the_file(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "out.json"
    write_text_atomic(path, OLD)
    write_text_atomic(path, "new")
    assert path.read_text() == "new"
    assert [p.name for p in path.parent.iterdir()] == ["out.json"]


def test_exception_mid_write_leaves_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    path.write_text(OLD)
    with pytest.raises(ZeroDivisionError), atomic_write(path) as file:
        file.write('{"half": ')
        raise ZeroDivisionError
    assert only_the_old_file(path)


def test_bench_json_and_plot_keep_the_old_file(tmp_path: Path, failing_fsync: None) -> None:
    for name in ("results.json", "plot.png"):
        path = tmp_path / name
        path.write_text(OLD)
        with pytest.raises(DiskFull):
            if name.endswith(".json"):
                report.write_json(path, {"runs": [1, 2, 3]})
            else:
                row = {"workload": "w", "peer": "p", "peer_label": "p", "cap": "none"}
                rows = [{**row, "tokens_per_s": 1.0, "status": "ok", "peak_allocated_gib": 1.0}]
                plots.plot(rows, path)
        assert path.read_text() == OLD
        path.unlink()
    assert list(tmp_path.iterdir()) == []


def test_hardware_cache_keeps_the_old_file(tmp_path: Path, failing_fsync: None) -> None:
    path = tmp_path / "hw.json"
    path.write_text(OLD)
    profile = HardwareProfile(1e9, 1e9, 2e9, 1e9, 1e10, 0, 0, 0, "cpu", "cpu")
    hardware.write_cache(path, {"k": 1}, profile)  # a cache that cannot be written only logs
    assert only_the_old_file(path)
    json.loads(OLD)
