"""Side-by-side benchmarks of autooffload against its peers: ``python -m autooffload.bench``.

Workloads live in :mod:`autooffload.bench.workloads`, peers in :mod:`autooffload.bench.peers`
(built on :mod:`autooffload.bench.trainee`; the autooffload peer in
:mod:`autooffload.bench.peer_autooffload`), one run per worker process
(:mod:`autooffload.bench._worker`), orchestration in :mod:`autooffload.bench.runner` (its
command-line values in :mod:`autooffload.bench.cli_values`), summaries and JSON in
:mod:`autooffload.bench.report`, the table in :mod:`autooffload.bench.table`, plots in
:mod:`autooffload.bench.plots`.
See ``docs/benchmarks.md``.
"""

from __future__ import annotations

from autooffload.bench.workloads import WORKLOADS, Workload, get_workload

__all__ = ["WORKLOADS", "Workload", "get_workload"]
