"""The group order a forward runs in drives the backward's chunk releases and prefetches. A
model whose first group to run is not its first registered one (Qwen2-VL embeds the tokens
before its vision tower runs) must still get a complete trace, and its backward must stay
within the chunk buffers."""

from __future__ import annotations

import pytest
import torch

from autooffload import runtime as rt
from autooffload.bench.models import accepted_batch, build_model, make_batch
from autooffload.bench.workloads import get_workload
from autooffload.runtime.chunks.store import Residency

pytestmark = pytest.mark.usefixtures("one_thread")
N_BUFFER = 5


def test_a_vlm_backward_releases_chunks_and_its_trace_is_complete(offload_cpu):
    workload = get_workload("qwen2vl-tiny-lora")
    offload_cpu(
        force_attach=True,
        chunk_size=1 << 16,
        n_persist=0,
        n_buffer=N_BUFFER,
        activation_mode="checkpoint",
    )
    model = build_model(workload)
    model.to("cpu")
    runtime = rt.runtime_of(model)
    manager = runtime.manager
    n_chunks = len(manager.chunks)
    assert n_chunks > 2 * N_BUFFER, n_chunks
    names = {g.index: g.name for g in runtime.groups}
    resident_in_backward: list[int] = []
    gather = manager.gather

    def counting_gather(index, *args, **kwargs):
        result = gather(index, *args, **kwargs)
        if torch._C._current_graph_task_id() != -1:
            resident_in_backward.append(sum(s != Residency.HOST for s in manager.state))
        return result

    manager.gather = counting_gather
    batch = accepted_batch(model, make_batch(workload))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    for _ in range(2):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    trace = [names[g] for g in runtime.last_trace]
    assert trace[0].endswith("embed_tokens"), trace
    assert any("visual" in name for name in trace) and trace[-1].endswith("lm_head"), trace
    assert resident_in_backward, "no chunk was gathered in the backward"
    assert max(resident_in_backward) <= N_BUFFER, resident_in_backward
