"""Which offloaded chunks the GPU updates beside the CPU, and when each chunk is ready.

The CPU optimizer updates offloaded chunks in forward order from ``optimizer.step()`` on, at
``cpu_optim_params_per_s``; the next forward's gathers wait for them. When the step is bound by
that update, the PCIe link is mostly idle: a chunk can instead be updated on the GPU with its
optimizer state streamed from pinned memory (``runtime/update/gpu_update.py``):

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


# ---- the update in the backward: the lowest offloaded chunks on the GPU --------------------------
#
# Under ``update_in_backward`` the CPU updates offloaded chunks in the order their gradients
# arrive: the highest first, chunk p (the first the next forward needs) last, so the forward
# waits for the whole CPU queue. The GPU instead updates the lowest k offloaded trainable
# chunks at the end of their backward, while their weights and gradients are still on the
# device (``GpuUpdater.update_resident``): only their optimizer state comes in (one backward
# window ahead) and goes out with the new weights, in place of the gradients:
#
#     state_in[w(c)]   += state[c]             w(c) = min(last[c] + 1, U - 1)
#     out[first[c]]    += bytes[c] + state[c] - grad_bytes[c]      (as ``grad_d2h_bytes``)
#     scratch[u]       += state[c]             for first[c] - 1 <= u <= w(c)
#
# The CPU keeps the higher chunks, which arrive first and are needed last; the forward waits for
# it at the gather of its lowest chunk q only: done = max(cpu_numel / rate - H(n - 1),
# numel[q] / rate - H(q), 0) (``cost_time.backward_update_done``).


@dataclass(frozen=True)
class BackwardSplit:
    """Per n_persist row p (shape ``(P, ...)``): the GPU / CPU split of the update in the
    backward (see the comment above)."""

    gpu_chunks: np.ndarray
    """(P,): k, the lowest offloaded trainable chunks updated on the GPU in the backward."""
    cpu_numel: np.ndarray
    """(P,): elements the CPU updates."""
    lowest_numel: np.ndarray
    """(P,): elements of the lowest CPU-updated chunk q (0 when none)."""
    lowest_first: np.ndarray
    """(P,): first unit of q (0 when none)."""
    cpu_units: np.ndarray
    """(P, U): whether the unit's forward gathers a CPU-updated chunk."""
    state_in: np.ndarray
    """(P, U): optimizer-state bytes copied in during the backward window of unit u."""
    out_delta: np.ndarray
    """(P, U): bytes copied out after unit u's backward beyond ``grad_d2h_bytes[p, u]``."""
    scratch: np.ndarray
    """(P, U): optimizer-state bytes on the device during unit u's backward."""


def state_bytes(profile: ModelProfile, chunk: int) -> int:
    """Optimizer-state bytes of ``chunk``'s trainable elements (the GPU path's scratch)."""
    return profile.optim_bytes_per_param * profile.chunks[chunk].trainable_numel


def backward_gpu_chunks(profile: ModelProfile, hw: HardwareProfile, n_persist: int) -> list[int]:
    """The offloaded chunks the GPU updates in the backward at ``n_persist``: the lowest k
    trainable ones; k is the setting when fixed, else the smallest k that leaves the next
    forward no wait for the CPU (or the least wait), estimated from the units' compute: the
    backward left after a chunk's gradients arrive, and the forward before its gather."""
    setting = profile.gpu_update_in_backward
    trainable = [
        c for c in range(n_persist, profile.n_chunks) if profile.chunks[c].trainable_numel > 0
    ]
    if setting == GPU_UPDATE_OFF or not profile.update_in_backward or not trainable:
        return []
    if setting > 0:
        return trainable[:setting]
    units = profile.units
    bwd_before = np.concatenate([[0.0], np.cumsum([u.bwd_s for u in units])])
    fwd_before = np.concatenate([[0.0], np.cumsum([u.fwd_s for u in units])])
    first, _ = chunk_spans(profile)
    rate = hw.cpu_optim_params_per_s
    numel = np.array([profile.chunks[c].trainable_numel for c in trainable], dtype=float)
    lowest_first = first[trainable]
    # k GPU chunks: the CPU takes trainable[k:], its lowest q = trainable[k] (k < m).
    cpu_s = np.cumsum(numel[::-1])[::-1] / rate
    top_left = bwd_before[first[trainable[-1]]]
    done = np.maximum(np.maximum(cpu_s - top_left, numel / rate - bwd_before[lowest_first]), 0.0)
    waits = np.append(np.maximum(0.0, done - fwd_before[lowest_first]), 0.0)
    k = int(np.argmin(waits + 1e-9 * np.arange(len(waits))))
    return trainable[:k]


def backward_split(
    profile: ModelProfile, hw: HardwareProfile, rows: np.ndarray | None = None
) -> BackwardSplit:
    """``BackwardSplit`` for every n_persist (or those in ``rows``)."""
    rows = np.arange(profile.n_chunks + 1) if rows is None else np.asarray(rows)
    n_units = profile.n_units
    first, last = chunk_spans(profile)
    shape = (len(rows), n_units)
    k = np.zeros(len(rows), dtype=np.int64)
    cpu_numel = np.zeros(len(rows))
    lowest_numel = np.zeros(len(rows))
    lowest_first = np.zeros(len(rows), dtype=np.int64)
    cpu_units = np.zeros(shape, dtype=bool)
    state_in = np.zeros(shape, dtype=np.int64)
    out_delta = np.zeros(shape, dtype=np.int64)
    scratch = np.zeros(shape, dtype=np.int64)
    for i, p in enumerate(int(r) for r in rows):
        on_gpu = set(backward_gpu_chunks(profile, hw, p))
        k[i] = len(on_gpu)
        cpu = [
            c
            for c in range(p, profile.n_chunks)
            if c not in on_gpu and profile.chunks[c].trainable_numel > 0
        ]
        cpu_numel[i] = sum(profile.chunks[c].trainable_numel for c in cpu)
        if cpu:
            lowest_numel[i] = profile.chunks[cpu[0]].trainable_numel
            lowest_first[i] = first[cpu[0]]
            cpu_units[i, first[cpu]] = True
        for c in on_gpu:
            state = state_bytes(profile, c)
            window = min(int(last[c]) + 1, n_units - 1)
            state_in[i, window] += state
            chunk = profile.chunks[c]
            out_delta[i, first[c]] += chunk.bytes + state - chunk.trainable_bytes
            scratch[i, max(0, int(first[c]) - 1) : window + 1] += state
    return BackwardSplit(
        k, cpu_numel, lowest_numel, lowest_first, cpu_units, state_in, out_delta, scratch
    )
