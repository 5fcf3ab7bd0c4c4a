"""Which offloaded chunks the GPU updates beside the CPU, and when each chunk is ready.

The CPU optimizer updates offloaded chunks in forward order from ``optimizer.step()`` on, at
``cpu_optim_params_per_s``; the next forward's gathers wait for them. When the step is bound by
that update, the PCIe link is mostly idle: a chunk can instead be updated on the GPU with its
optimizer state streamed from pinned memory (``runtime/gpu_update.py``):

    h2d[c] = bytes[c] + grad_bytes[c] + state_bytes_per_param * numel[c]    (weights, grads, state)
    d2h[c] = bytes[c] + state_bytes_per_param * numel[c]                    (weights, state back)
    t_gpu[c] = transfer_s(h2d[c], d2h[c])    (two copy streams: chunk c+1 in while c goes out)

Per ``n_persist`` p, the last k offloaded trainable chunks take the GPU path (the next forward
needs them last) and the first m - k the CPU's; the two run at once. k is the ``gpu_update``
setting when fixed, else the smallest k minimising max(CPU time, GPU time). Each chunk's update
is done at
    done[c] = sum(numel of CPU chunks p..c) / cpu_rate     (c on the CPU path, or frozen)
            = sum(t_gpu of GPU chunks p..c)                (c on the GPU path)
and a forward gather at unit u may start at ``ready_s[p, u]`` = max(done[c] for the chunks it
gathers). The GPU path holds two sets of scratch (weights, grads laid out as the weights, state
of the largest chunk)
from ``step()`` until its last chunk is back: ``scratch_bytes[p]``, a term of the step's memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autooffload.plan.profile_types import HardwareProfile, ModelProfile
from autooffload.plan.residency import chunk_spans, transfer_s

# ``ModelProfile.gpu_update``: off (CPU only), or let the cost model choose k per n_persist.
GPU_UPDATE_OFF = 0
GPU_UPDATE_AUTO = -1
SCRATCH_SETS = 2


@dataclass(frozen=True)
class UpdateSplit:
    """Per n_persist row p (shape ``(n_chunks + 1, ...)``): the CPU / GPU split of the update."""

    ready_s: np.ndarray
    """(P, U): seconds after ``step()`` until every chunk gathered at u is updated; -inf where
    u gathers no offloaded chunk."""
    gpu_chunks: np.ndarray
    """(P,): k, the offloaded trainable chunks updated on the GPU (the last k)."""
    cpu_numel: np.ndarray
    """(P,): elements the CPU updates."""
    cpu_s: np.ndarray
    """(P,): seconds of the CPU path."""
    gpu_s: np.ndarray
    """(P,): seconds of the GPU path."""
    scratch_bytes: np.ndarray
    """(P,): device bytes the GPU path holds during the step (0 when k = 0)."""


def gpu_chunk_s(profile: ModelProfile, hw: HardwareProfile, chunk: int) -> float:
    """Seconds of the GPU path per chunk (the module docstring's t_gpu)."""
    c = profile.chunks[chunk]
    state = profile.optim_bytes_per_param * c.trainable_numel
    return transfer_s(c.bytes + c.trainable_bytes + state, c.bytes + state, hw)


def all_gpu_chunk_s(profile: ModelProfile, hw: HardwareProfile) -> np.ndarray:
    """``gpu_chunk_s`` of every chunk."""
    return np.array([gpu_chunk_s(profile, hw, c) for c in range(profile.n_chunks)])


def scratch_bytes_of(profile: ModelProfile, chunks: list[int]) -> int:
    """Device bytes of the GPU path's scratch for ``chunks``: two sets of the largest."""
    if not chunks:
        return 0
    per = [
        2 * profile.chunks[c].bytes
        + profile.optim_bytes_per_param * profile.chunks[c].trainable_numel
        for c in chunks
    ]
    return SCRATCH_SETS * max(per)


def gpu_update_chunks(
    profile: ModelProfile, hw: HardwareProfile, n_persist: int, t_gpu: np.ndarray | None = None
) -> list[int]:
    """The chunks updated on the GPU at ``n_persist`` (the last k offloaded trainable ones);
    ``t_gpu``: ``gpu_chunk_s`` of every chunk, if already computed."""
    trainable = [
        c for c in range(n_persist, profile.n_chunks) if profile.chunks[c].trainable_numel > 0
    ]
    setting = profile.gpu_update
    if setting == GPU_UPDATE_OFF or profile.update_in_backward or not trainable:
        return []
    if setting > 0:
        k = min(setting, len(trainable))
    else:
        numel = np.array([profile.chunks[c].trainable_numel for c in trainable], dtype=float)
        cpu_prefix = np.concatenate([[0.0], np.cumsum(numel)]) / hw.cpu_optim_params_per_s
        if t_gpu is None:
            t_gpu = all_gpu_chunk_s(profile, hw)
        times = t_gpu[trainable]
        gpu_suffix = np.concatenate([np.cumsum(times[::-1])[::-1], [0.0]])
        m = len(trainable)
        # k GPU chunks: CPU runs trainable[:m-k], GPU trainable[m-k:].
        finish = [max(cpu_prefix[m - k], gpu_suffix[m - k]) for k in range(m + 1)]
        k = int(np.argmin(finish))  # the first minimum: the smallest k
    return trainable[len(trainable) - k :]


def update_split_row(
    profile: ModelProfile, hw: HardwareProfile, p: int, t_gpu: np.ndarray | None = None
) -> tuple[np.ndarray, int, float, float, float, int]:
    """Row p of ``update_split``: (ready_s[U], k, cpu_numel, cpu_s, gpu_s, scratch_bytes)."""
    n, rate = profile.n_chunks, hw.cpu_optim_params_per_s
    if t_gpu is None and profile.gpu_update != GPU_UPDATE_OFF:
        t_gpu = all_gpu_chunk_s(profile, hw)
    on_gpu = set(gpu_update_chunks(profile, hw, p, t_gpu))
    done = np.zeros(n)
    cpu_numel, gpu_s = 0.0, 0.0
    for c in range(p, n):
        if c in on_gpu:
            assert t_gpu is not None
            gpu_s += float(t_gpu[c])
            done[c] = gpu_s
        else:
            cpu_numel += profile.chunks[c].trainable_numel
            done[c] = cpu_numel / rate
    first, _ = chunk_spans(profile)
    ready = np.full(profile.n_units, -np.inf)
    for c in range(p, n):
        # A forward gathers a chunk at the first unit of its span (``chunk_tables``).
        ready[first[c]] = max(ready[first[c]], done[c])
    scratch = scratch_bytes_of(profile, sorted(on_gpu))
    return ready, len(on_gpu), cpu_numel, cpu_numel / rate, gpu_s, scratch


def update_split(
    profile: ModelProfile, hw: HardwareProfile, rows: np.ndarray | None = None
) -> UpdateSplit:
    """``update_split_row`` for every n_persist (or those in ``rows``), stacked."""
    rows = np.arange(profile.n_chunks + 1) if rows is None else np.asarray(rows)
    t_gpu = all_gpu_chunk_s(profile, hw) if profile.gpu_update != GPU_UPDATE_OFF else None
    parts = [update_split_row(profile, hw, int(p), t_gpu) for p in rows]
    return UpdateSplit(
        ready_s=np.array([r[0] for r in parts]).reshape(len(parts), profile.n_units),
        gpu_chunks=np.array([r[1] for r in parts], dtype=np.int64),
        cpu_numel=np.array([r[2] for r in parts]),
        cpu_s=np.array([r[3] for r in parts]),
        gpu_s=np.array([r[4] for r in parts]),
        scratch_bytes=np.array([r[5] for r in parts], dtype=np.int64),
    )
