"""``autooffload.fsdp2_wrap`` shards by size, and a model sharded by FSDP2 is left to FSDP2: a
move to the device does not attach it, and it trains (one process, gloo, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from runtime.runtime_models import batches, tiny_llama
from torch.distributed.fsdp import FSDPModule
from torchrun import free_port
from torchrun import launch as launch_worker

import autooffload
from autooffload import runtime as rt


@pytest.fixture
def one_rank_group(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_size_policy_shards_each_big_module_once_then_the_root(one_rank_group):
    model = tiny_llama(n_layers=3, hidden=32)
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    autooffload.fsdp2_wrap(model, min_num_params=layer)
    units = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    # Each decoder layer reaches the bound on its own; nothing inside one does; the root.
    # the embedding alone (4k params) stays in the root's unit.
    assert units == ["", "model.layers.0", "model.layers.1", "model.layers.2"]


def test_a_sharded_model_is_not_attached_and_trains(one_rank_group):
    autooffload.enable(device="cpu", force_attach=True, mask=False)
    model = autooffload.fsdp2_wrap(tiny_llama(), min_num_params=10_000)
    model.to("cpu")
    assert rt.runtime_of(model) is None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    (ids,) = batches(1)
    for _ in range(6):  # the same batch: its loss falls as it is memorised
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "big"])
def test_bad_min_num_params_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="min_num_params must be a positive int"):
        autooffload.fsdp2_wrap(tiny_llama(), min_num_params=bad)


WORKER = Path(__file__).with_name("fsdp2_worker.py")


def check_fsdp2_ranks(out: Path, device: str, nproc: int) -> None:
    """``fsdp2_wrap`` with masking and HF gradient checkpointing under ``enable()`` trains like
    plain FSDP2 with the same wrap on the same labels, on every rank; labels are masked to the
    assistant answers."""
    reports = launch_worker(WORKER, out, f"--device={device}", nproc=nproc)
    for report in reports:
        assert report["world"] == nproc
        assert not report["attached"]  # FSDP2 keeps its own weights
        # The embedding and the head (151k x 32 each), three decoder layers, then the root.
        assert report["units"] == 6
        assert report["losses"] == report["plain_losses"]
        assert report["weights_max_diff"] == 0.0
        assert report["masked_tokens"] > report["unmasked_tokens"]
        for text in report["kept_label_texts"]:
            assert text.startswith("<think>") and text.endswith("<|im_end|>"), text
            assert "It is " in text and "user" not in text and "system" not in text, text


def test_fsdp2_wrap_composes_with_masking_and_checkpointing_on_two_gloo_ranks(tmp_path):
    check_fsdp2_ranks(tmp_path, "cpu", 2)


@pytest.mark.multigpu
@pytest.mark.parametrize("nproc", [2, 4])
def test_fsdp2_wrap_composes_with_masking_and_checkpointing_over_nccl(tmp_path, nproc):
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} CUDA devices, found {torch.cuda.device_count()}")
    check_fsdp2_ranks(tmp_path, "cuda", nproc)
