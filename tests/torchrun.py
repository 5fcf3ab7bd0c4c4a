"""Launch a test worker script on several ranks with ``torchrun`` and read each rank's report."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(
    worker: Path, out: Path, *args: str, nproc: int = 2, expect_failure: bool = False
) -> list[dict]:
    """Run ``worker --out OUT ARGS`` on ``nproc`` ranks; each rank writes ``OUT/rank<r>.json``.

    Fails the test with the workers' output when a rank wrote no report or reported an error,
    or (``expect_failure``) when the job did not fail.
    """
    out.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
        str(worker),
        f"--out={out}",
        *args,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    reports = []
    for rank in range(nproc):
        path = out / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no report:\n{done.stdout}\n{done.stderr}"
        report = json.loads(path.read_text())
        assert "error" not in report, report["error"]
        reports.append(report)
    if expect_failure:
        assert done.returncode != 0, "the job was expected to fail"
    else:
        assert done.returncode == 0, done.stderr
    return reports
