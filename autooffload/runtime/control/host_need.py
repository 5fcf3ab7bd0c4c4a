"""The host memory a runtime allocates for its chunk layout, checked before attach allocates any
against what the host has available and ``AUTOOFFLOAD_HOST_BUDGET``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from autooffload.errors import PlanError
from autooffload.log import logger
from autooffload.runtime.activations.swap import SIZE_CLASS_ROUNDING
from autooffload.runtime.chunks.host import HostMemory, host_memory
from autooffload.runtime.chunks.layout import ALIGN, ChunkLayout
from autooffload.settings import Settings

# CPU optimizer states per offloaded trainable element at attach, when the optimizer is not
# known yet: Adam-family (two states), the common and the largest case.
HOST_OPTIM_STATES = 2


def host_bytes_needed(
    layout: ChunkLayout,
    n_persist: int,
    master_weights: bool,
    hosts: Callable[[int], bool] | None = None,
) -> dict[str, int]:
    """Host bytes the runtime allocates for ``layout``, by part: the host store (every chunk),
    the gradient staging (every trainable param, aligned), fp32 masters of offloaded
    low-precision params (``master_weights``), and for offloaded trainable params the host
    gradients plus ``HOST_OPTIM_STATES`` optimizer states in the master dtype. ``hosts``: the
    chunks this rank keeps on its host (sharded state: frozen ones and those it owns)."""
    mine = [c for c in layout.chunks if hosts is None or hosts(c.index)]
    staging = sum(
        (slot.nbytes + ALIGN - 1) // ALIGN * ALIGN for chunk in mine for slot in chunk.trained_slots
    )
    masters = optimizer = 0
    for chunk in mine:
        if chunk.index < n_persist:
            continue
        for slot in chunk.trained_slots:
            dtype = slot.dtype
            widened = master_weights and dtype != torch.float32 and dtype.is_floating_point
            master_bytes = 4 * slot.numel if widened else slot.nbytes
            masters += master_bytes if widened else 0
            optimizer += (1 + HOST_OPTIM_STATES) * master_bytes
    return {
        "host store": sum(c.nbytes for c in mine),
        "gradient staging": staging,
        "masters": masters,
        "host grads + optimizer state": optimizer,
    }


def chunk_host_bytes(layout: ChunkLayout, master_weights: bool) -> list[int]:
    """Host bytes each chunk costs the rank hosting it while offloaded: ``host_bytes_needed``'s
    parts, chunk by chunk (sharded state balances ownership by them)."""
    return [
        sum(host_bytes_needed(layout, 0, master_weights, lambda i, c=c.index: i == c).values())
        for c in layout.chunks
    ]


def host_memory_now() -> HostMemory | None:
    """The host's RAM as /proc and the cgroup show it now (see ``check_host_memory``)."""
    return host_memory()


def check_host_memory(
    layout: ChunkLayout,
    n_persist: int,
    settings: Settings,
    reclaimable_bytes: int = 0,
    memory: HostMemory | None = None,
    hosts: Callable[[int], bool] | None = None,
    local_ranks: int = 1,
) -> None:
    """Raise ``PlanError`` before any allocation if the host memory the runtime needs exceeds
    what the machine (its cgroup limit included) has available, or ``settings.host_budget``.

    ``reclaimable_bytes``: host bytes the attach frees (the model's own CPU parameters, which
    the host store replaces). ``memory``: the host's RAM; read from /proc and the cgroup if None.
    ``hosts``: as for ``host_bytes_needed``. ``local_ranks``: data-parallel ranks sharing this
    host (``LOCAL_WORLD_SIZE``), each needing about as much and freeing its own model's bytes;
    ``memory`` must then be read before any of them allocates (the runtime reads it before
    its first collective). ``AUTOOFFLOAD_HOST_BUDGET`` is per rank.
    """
    memory = memory if memory is not None else host_memory()
    parts = host_bytes_needed(layout, n_persist, settings.master_weights, hosts)
    needed = sum(parts.values())
    limits = []
    if memory is not None:
        source = "available host memory"
        if memory.cgroup_limited:
            source += " (container cgroup limit)"
        if local_ranks > 1:
            source += f" shared by the {local_ranks} ranks on this host"
        limits.append(((memory.available_bytes // local_ranks) + reclaimable_bytes, source))
    if settings.host_budget is not None:
        total = memory.total_bytes if memory is not None else None
        if isinstance(settings.host_budget, float) and total is None:
            logger.debug("host RAM unknown; AUTOOFFLOAD_HOST_BUDGET as a fraction is not checked")
        else:
            budget = Settings.resolve_bytes(settings.host_budget, total or 0)
            limits.append((budget, f"AUTOOFFLOAD_HOST_BUDGET={settings.host_budget}"))
    if not limits:
        return
    limit, source = min(limits, key=lambda item: item[0])
    if needed <= limit:
        return
    gib = 1 << 30
    per_rank = " per rank" if local_ranks > 1 else ""
    detail = ", ".join(f"{name} {value / gib:.2f}" for name, value in parts.items() if value)
    raise PlanError(
        f"autooffload needs {needed / gib:.2f} GiB of host memory{per_rank} ({detail} GiB)"
        f" but {limit / gib:.2f} GiB are allowed by the {source}; raise AUTOOFFLOAD_HOST_BUDGET,"
        f" keep more chunks on the GPU (a larger AUTOOFFLOAD_N_PERSIST than {n_persist}),"
        " set AUTOOFFLOAD_MASTER_WEIGHTS=0, or free host memory"
    )


# Of the host memory available, the share activations kept there (swapped blocks' saved tensors,
# checkpointed blocks' inputs) may take (the rest for the process's own growth: pinned copies,
# the data loader, the optimizer's threads).
HOST_ACTIVATIONS_SHARE = 0.8


def host_room_for_activations(held_bytes: int = 0, local_ranks: int = 1) -> int | None:
    """Host bytes this rank's activations (swapped blocks' saved tensors, checkpointed blocks'
    inputs) may take: ``HOST_ACTIVATIONS_SHARE`` of the memory available now (its share where
    ``local_ranks`` share the host), less what the swapper's pool rounds their buffers up by
    (``SIZE_CLASS_ROUNDING``), plus ``held_bytes`` the rank already holds for them (its
    swapper's pool); None where the host's RAM is unknown."""
    memory = host_memory_now()
    if memory is None:
        return None
    share = HOST_ACTIVATIONS_SHARE * memory.available_bytes / max(1, local_ranks)
    return int(share / (1 + SIZE_CLASS_ROUNDING)) + held_bytes
