"""Reading and clipping the host gradients of offloaded params (``CpuOptimizer`` mixes it in).

Gradients of offloaded params accumulate in host memory, beside their masters. The 2-norm that
``clip_grad_norm_`` needs comes from per-param norms taken on the device as the gradients left
it (``device_norms``), unless they were accumulated over several backward passes on the host
(summed on the GPU, the norm is taken after the add: ``norm_of_sum``); clipping over
all of them is a lazy coefficient (``clip_coef``) that the update task applies, so neither
needs a pass over host memory in the common case. Under sharded state (``runtime/sharding.py``)
the norm is a collective over every rank's share.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from autooffload.runtime.sharding import Sharding


class HostGradNorms:
    """Host-gradient reads, norms and clipping over ``masters`` (state owned by CpuOptimizer)."""

    masters: dict[int, torch.Tensor]
    device_norms: dict[int, torch.Tensor]
    accumulations: dict[int, int]
    norm_of_sum: set[int]
    offloaded_ids: set[int]
    clip_coef: float
    sharding: Sharding | None

    if TYPE_CHECKING:  # CpuOptimizer's

        def check_no_early_update(self, what: str) -> None: ...

        def wait(self) -> None: ...

    def host_grads(self) -> list[torch.Tensor]:
        """The accumulated gradients of offloaded params, pending clipping applied."""
        self.check_no_early_update("reading the offloaded gradients (GradScaler, clipping)")
        self.wait()
        grads = [m.grad for m in self.masters.values() if m.grad is not None]
        if grads and self.clip_coef != 1.0:
            torch._foreach_mul_(grads, self.clip_coef)
            self.device_norms = {k: v * self.clip_coef for k, v in self.device_norms.items()}
            self.clip_coef = 1.0
        return grads

    def host_grad_norm(self, norm_type: float, param_ids: set[int]) -> torch.Tensor | None:
        """Norm of the host gradients of ``param_ids`` (None without any). The 2-norm over all
        of them comes from the per-param sums of squares taken during accumulation. Sharded,
        a collective: the norm over every rank's share."""
        self.check_no_early_update("clip_grad_norm_")
        if self.sharding is not None:
            return self._sharded_norm(norm_type, param_ids)
        return self._local_norm(norm_type, param_ids)

    def _sharded_norm(self, norm_type: float, param_ids: set[int]) -> torch.Tensor | None:
        assert self.sharding is not None
        local = self._local_norm(norm_type, param_ids)
        if not any(pid in param_ids for pid in self.offloaded_ids):
            return None  # the same answer on every rank: no collective needed
        value = torch.zeros((), dtype=torch.float32) if local is None else local.float().cpu()
        if math.isinf(norm_type):
            return self.sharding.all_reduce_(value, torch.distributed.ReduceOp.MAX)
        powered = self.sharding.all_reduce_(value.pow(norm_type))
        return powered.pow(1.0 / norm_type)

    def _local_norm(self, norm_type: float, param_ids: set[int]) -> torch.Tensor | None:
        self.wait()
        # In layout order, not the set's (ids are addresses): the sum, hence the clipping
        # coefficient, must be bit-identical run to run and across data-parallel ranks.
        present = [
            pid for pid, m in self.masters.items() if pid in param_ids and m.grad is not None
        ]
        if not present:
            return None
        if norm_type != 2.0 or not self.covers_all(param_ids):
            self.host_grads()  # apply any pending coefficient first
            grads = [self.masters[pid].grad for pid in present]
            return torch.nn.utils.get_total_norm(grads, norm_type, False, False)
        parts = []
        for pid in present:
            norm = self.device_norms.get(pid)
            host_sum = self.accumulations.get(pid, 0) != 1 and pid not in self.norm_of_sum
            if norm is None or host_sum:
                # Accumulated over several backward passes on the host: only the host sum has
                # the norm.
                grad = self.masters[pid].grad
                norm = torch.linalg.vector_norm(grad, 2, dtype=torch.float32)
                norm = norm.to(next(iter(self.device_norms.values()), norm).device)
            parts.append(norm)
        return torch.linalg.vector_norm(torch.stack(parts), 2) * self.clip_coef

    def covers_all(self, param_ids: set[int]) -> bool:
        """Whether ``param_ids`` includes every offloaded param that has a host gradient."""
        return all(pid in param_ids for pid, m in self.masters.items() if m.grad is not None)

    def clip_(self, coef: float, param_ids: set[int]) -> None:
        """Scale the host gradients of ``param_ids`` by ``coef`` (gradient clipping). Over all
        of them it is lazy: the update task applies it (``host_grads`` does for readers)."""
        if math.isclose(coef, 1.0):
            return
        self.check_no_early_update("gradient clipping")
        if self.covers_all(param_ids):
            self.clip_coef *= coef
            return
        self.host_grads()
        grads = [
            m.grad for pid, m in self.masters.items() if pid in param_ids and m.grad is not None
        ]
        if grads:
            torch._foreach_mul_(grads, coef)
        for pid in param_ids:
            if pid in self.device_norms:
                self.device_norms[pid] = self.device_norms[pid] * coef

    def clamp_(self, clip_value: float, param_ids: set[int]) -> None:
        """Clamp the host gradients of ``param_ids`` to ``[-clip_value, clip_value]``
        (``clip_grad_value_``); their norms taken on the device no longer hold."""
        self.check_no_early_update("clip_grad_value_")
        self.host_grads()  # a pending clipping coefficient first
        grads = [
            m.grad for pid, m in self.masters.items() if pid in param_ids and m.grad is not None
        ]
        for grad in grads:
            grad.clamp_(-clip_value, clip_value)
        for pid in param_ids:
            self.device_norms.pop(pid, None)
