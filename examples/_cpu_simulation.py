"""The plain-torch example on a machine without a GPU: a simulated device half the size plain
training needs, and the one-line summary comparing the attached run with plain training."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

import autooffload
from autooffload.plan.types import Plan

MiB = 1 << 20


def plain_device_bytes(model: PreTrainedModel, input_ids: torch.Tensor) -> int:
    """What plain training holds on the device at the end of a forward, measured on a plain
    (unattached) model: weights, gradients and AdamW's two states (four times the weights'
    bytes), and the activations autograd saves for the backward."""
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=input_ids, labels=input_ids).loss
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    del loss
    return 4 * weights + sum(saved.values())


def simulate_small_device(build: Callable[[], PreTrainedModel], input_ids: torch.Tensor) -> int:
    """Re-enable autooffload with a device budget of half what plain training of ``build()``
    needs and one chunk per decoder layer (unless ``AUTOOFFLOAD_BUDGET`` /
    ``AUTOOFFLOAD_CHUNK_SIZE`` set them); return what plain training needs."""
    autooffload.disable()  # measure the plain model, with no autooffload patch in the way
    model = build()
    plain_bytes = plain_device_bytes(model, input_ids)
    overrides = {}
    if "AUTOOFFLOAD_BUDGET" not in os.environ:
        overrides["budget"] = plain_bytes // 2
    if "AUTOOFFLOAD_CHUNK_SIZE" not in os.environ:
        layer = model.model.layers[0]
        overrides["chunk_size"] = sum(p.numel() * p.element_size() for p in layer.parameters())
    autooffload.enable(**overrides)
    return plain_bytes


def summary(
    plan: Plan | None, plain_bytes: int | None, losses: list[float], plain: list[float] | None
) -> str:
    """One line: what plain training needs on the device, what the plan used, the losses."""
    parts = []
    if plain_bytes is not None:
        parts.append(
            f"plain training needs {plain_bytes / MiB:.1f} MiB on the device (weights,"
            " gradients, AdamW states, saved activations)"
        )
    if plan is None:
        parts.append(
            "autooffload did not attach the model (AUTOOFFLOAD=0, or a model under the 1 GiB"
            " attach threshold without AUTOOFFLOAD_FORCE_ATTACH=1)"
        )
    else:
        n_off = plan.n_chunks - plan.n_persist
        budget = "no budget" if plan.budget_bytes is None else f"{plan.budget_bytes / MiB:.1f} MiB"
        parts.append(
            f"autooffload planned a {plan.predicted_peak_bytes / MiB:.1f} MiB peak under a"
            f" {budget} budget by streaming {n_off} of {plan.n_chunks} weight chunks from host"
            f" memory, recomputing {plan.n_checkpoint} of {len(plan.block_policies)} layers'"
            f" activations and swapping {plan.n_swap} to the host"
        )
    if plain is not None:
        gap = max(abs(a - b) for a, b in zip(losses, plain))
        same = "exactly" if gap == 0 else f"to within {gap:.1e} (AdamW kernels' rounding)"
        parts.append(f"its {len(losses)} losses equal plain training's {same}")
    return "summary: " + "; ".join(parts)
