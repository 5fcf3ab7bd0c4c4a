"""Side-by-side benchmarks of autooffload against its peers: ``python -m autooffload.bench``.

Workloads live in :mod:`autooffload.bench.workloads`, peers in :mod:`autooffload.bench.peers`,
one run per worker process (:mod:`autooffload.bench._worker`), orchestration in
:mod:`autooffload.bench.runner` and tables / JSON / plots in :mod:`autooffload.bench.report`.
See ``docs/benchmarks.md``.
"""

from __future__ import annotations

from autooffload.bench.workloads import WORKLOADS, Workload, get_workload

__all__ = ["WORKLOADS", "Workload", "get_workload"]
