"""The plan a runtime starts with: user overrides first, then a memory-bounded default."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from autooffload.errors import PlanError
from autooffload.plan.types import Plan
from autooffload.settings import Settings

if TYPE_CHECKING:
    from autooffload.runtime.runtime import Runtime

# Share of the budget the default plan leaves for activations, buffers and transients until
# the profiler measures them on the real batch.
ACTIVATION_RESERVE = 0.4


def budget_bytes(settings: Settings, device: torch.device) -> int | None:
    """The GPU memory budget in bytes: ``settings.budget`` (bytes or a fraction of the device),
    capped by what the device has free; ``None`` on the CPU simulation without a budget."""
    if device.type != "cuda":
        if settings.budget is None or isinstance(settings.budget, float):
            return None
        return int(settings.budget)
    free, total = torch.cuda.mem_get_info(device)
    fraction_cap = total
    limit = Settings.resolve_bytes(settings.budget, total) if settings.budget is not None else None
    available = free + torch.cuda.memory_reserved(device)
    if limit is None:
        return min(available, fraction_cap) - (1 << 30)
    return min(limit, available)


def persistent_cost(chunk_bytes: int, trainable_bytes: int) -> int:
    """GPU bytes a chunk costs when persistent: weights, their grads and two optimizer states
    in the param dtype (torch AdamW on bf16 params): nbytes + 3 * trainable bytes."""
    return chunk_bytes + 3 * trainable_bytes


def initial_plan(runtime: Runtime, settings: Settings) -> Plan:
    """The plan used until the profiler has measured the real batch."""
    chunks = runtime.layout.chunks
    n_chunks = len(chunks)
    chunk_size = runtime.layout.chunk_size
    widest = max((len(v) for v in runtime.layout.chunks_of_group.values()), default=1)
    n_buffer = settings.n_buffer if settings.n_buffer is not None else 2 * widest
    if n_buffer < widest and settings.n_buffer is not None:
        raise PlanError(
            f"n_buffer={settings.n_buffer} is smaller than the {widest} chunks one block needs;"
            f" set AUTOOFFLOAD_N_BUFFER >= {widest} (or leave it unset)"
        )
    budget = budget_bytes(settings, runtime.device)
    if settings.n_persist is not None:
        if settings.n_persist > n_chunks:
            raise PlanError(
                f"n_persist={settings.n_persist} exceeds the model's {n_chunks} chunks;"
                f" set AUTOOFFLOAD_N_PERSIST between 0 and {n_chunks}"
            )
        n_persist = settings.n_persist
        source = "user"
    elif not settings.offload:
        n_persist = n_chunks
        source = "offload off"
    elif budget is None:
        n_persist = n_chunks if runtime.device.type == "cuda" else 0
        source = "default"
    else:
        buffers = n_buffer * max(c.nbytes for c in chunks) if chunks else 0
        room = int(budget * (1 - ACTIVATION_RESERVE)) - buffers
        n_persist, used = 0, 0
        for chunk in chunks:
            cost = persistent_cost(chunk.nbytes, chunk.trainable_bytes)
            if used + cost > room:
                break
            used += cost
            n_persist += 1
        source = "default"
    persistent_bytes = sum(persistent_cost(c.nbytes, c.trainable_bytes) for c in chunks[:n_persist])
    n_off = n_chunks - n_persist
    streamed = min(n_buffer, n_off) * max((c.nbytes for c in chunks[n_persist:]), default=0)
    return Plan(
        chunk_size=chunk_size,
        n_chunks=n_chunks,
        n_persist=n_persist,
        n_buffer=n_buffer,
        budget_bytes=budget,
        predicted_peak_bytes=persistent_bytes + streamed,
        bottleneck="not profiled yet (model states only)",
        source=source,
    )
