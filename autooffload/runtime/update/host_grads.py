"""Reading and clipping the host gradients of offloaded params (``HostGradNorms``).

Gradients of offloaded params accumulate in host memory, beside their masters (``master.grad``).
The 2-norm that ``clip_grad_norm_`` needs comes from per-param norms taken on the device as the
gradients left it (``device_norms``), wherever such a norm is the norm of the whole host
gradient (``whole_norms``: the first backward since ``zero_grad``, or a sum the GPU added before
taking it); clipping over all of them is a lazy coefficient (``clip_coef``) that the update task
applies, so neither needs a pass over host memory in the common case. Under sharded state
(``runtime/parallel/sharding.py``) the norm is a collective over every rank's share.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from autooffload.runtime.parallel.sharding import Sharding
    from autooffload.runtime.update.in_backward import EarlyUpdates


class HostGradNorms:
    """Host-gradient reads, norms and clipping of the offloaded params' masters."""

    def __init__(
        self,
        masters: dict[int, torch.Tensor],
        offloaded_ids: set[int],
        sharding: Sharding | None,
        wait: Callable[[], None],
        early: EarlyUpdates,
    ) -> None:
        """``masters`` and ``offloaded_ids`` are the CPU optimizer's (read here); ``wait``
        blocks until its queued work is done; ``early``: what the update in the backward did,
        which a read of the gradients must not follow."""
        self._masters = masters
        self._offloaded_ids = offloaded_ids
        self._sharding = sharding
        self._wait = wait
        self._early = early
        # Per param: the device-side norm of its last backward's gradient.
        self.device_norms: dict[int, torch.Tensor] = {}
        # Params whose ``device_norms`` entry is the norm of their whole host gradient, which
        # clipping can use as it is.
        self.whole_norms: set[int] = set()
        # Gradient clipping is applied lazily: the coefficient scales the host gradients in
        # the update task, on the worker, instead of a pass over them on the critical path.
        self.clip_coef = 1.0

    def record(self, param_id: int, norm: torch.Tensor, whole: bool) -> None:
        """A gradient of the param left the device with ``norm``; ``whole``: the norm of its
        whole host gradient (the first backward since zero_grad, or a sum taken on the device)."""
        self.device_norms[param_id] = norm
        if whole:
            self.whole_norms.add(param_id)
        else:
            self.whole_norms.discard(param_id)

    def forget(self, param_ids: set[int]) -> None:
        """The host gradients of ``param_ids`` were cleared (or their chunk left the CPU)."""
        for pid in param_ids:
            self.device_norms.pop(pid, None)
            self.whole_norms.discard(pid)

    def clear(self) -> None:
        """Every host gradient was cleared (``zero_grad``): no norm, no pending clipping."""
        self.device_norms.clear()
        self.whole_norms.clear()
        self.clip_coef = 1.0

    def close(self) -> None:
        """At detach: no norms, and no ``wait`` of the CPU optimizer (a cycle through it that
        would keep its params and host tensors alive until a cyclic gc)."""
        self.clear()
        del self._wait

    def reset_clip(self) -> None:
        """The pending clipping coefficient went to the updates just queued."""
        self.clip_coef = 1.0

    def host_grads(self) -> list[torch.Tensor]:
        """The accumulated gradients of offloaded params, pending clipping applied."""
        self._early.check_no_early_update("reading the offloaded gradients (GradScaler, clipping)")
        self._wait()
        grads = [m.grad for m in self._masters.values() if m.grad is not None]
        if grads and self.clip_coef != 1.0:
            torch._foreach_mul_(grads, self.clip_coef)
            self.device_norms = {k: v * self.clip_coef for k, v in self.device_norms.items()}
            self.clip_coef = 1.0
        return grads

    def host_grad_norm(self, norm_type: float, param_ids: set[int]) -> torch.Tensor | None:
        """Norm of the host gradients of ``param_ids`` (None without any). The 2-norm over all
        of them comes from the per-param norms taken on the device. Sharded, a collective: the
        norm over every rank's share."""
        self._early.check_no_early_update("clip_grad_norm_")
        if self._sharding is not None:
            return self._sharded_norm(norm_type, param_ids)
        return self._local_norm(norm_type, param_ids)

    def _sharded_norm(self, norm_type: float, param_ids: set[int]) -> torch.Tensor | None:
        assert self._sharding is not None
        local = self._local_norm(norm_type, param_ids)
        if not any(pid in param_ids for pid in self._offloaded_ids):
            return None  # the same answer on every rank: no collective needed
        value = torch.zeros((), dtype=torch.float32) if local is None else local.float().cpu()
        if math.isinf(norm_type):
            return self._sharding.all_reduce_(value, torch.distributed.ReduceOp.MAX)
        powered = self._sharding.all_reduce_(value.pow(norm_type))
        return powered.pow(1.0 / norm_type)

    def _local_norm(self, norm_type: float, param_ids: set[int]) -> torch.Tensor | None:
        self._wait()
        # In layout order, not the set's (ids are addresses): the sum, hence the clipping
        # coefficient, must be bit-identical run to run and across data-parallel ranks.
        present = [
            pid for pid, m in self._masters.items() if pid in param_ids and m.grad is not None
        ]
        if not present:
            return None
        if norm_type != 2.0 or not self.covers_all(param_ids):
            self.host_grads()  # apply any pending coefficient first
            grads = [self._masters[pid].grad for pid in present]
            return torch.nn.utils.get_total_norm(grads, norm_type, False, False)
        parts = []
        for pid in present:
            norm = self.device_norms.get(pid)
            if norm is None or pid not in self.whole_norms:
                # Accumulated over several backward passes on the host: only the host sum has
                # the norm.
                grad = self._masters[pid].grad
                norm = torch.linalg.vector_norm(grad, 2, dtype=torch.float32)
                norm = norm.to(next(iter(self.device_norms.values()), norm).device)
            parts.append(norm)
        return torch.linalg.vector_norm(torch.stack(parts), 2) * self.clip_coef

    def covers_all(self, param_ids: set[int]) -> bool:
        """Whether ``param_ids`` includes every offloaded param that has a host gradient, or
        one on its way: a gradient received (its norm recorded) is set on the master by the
        worker later, so the masters alone would miss those still queued (another optimizer's
        ``zero_grad`` then cleared them all)."""
        if any(pid not in param_ids for pid in self.device_norms):
            return False
        return all(pid in param_ids for pid, m in self._masters.items() if m.grad is not None)

    def clip_(self, coef: float, param_ids: set[int]) -> None:
        """Scale the host gradients of ``param_ids`` by ``coef`` (gradient clipping). Over all
        of them it is lazy: the update task applies it (``host_grads`` does for readers)."""
        if math.isclose(coef, 1.0):
            return
        self._early.check_no_early_update("gradient clipping")
        if self.covers_all(param_ids):
            self.clip_coef *= coef
            return
        self.host_grads()
        grads = [
            m.grad for pid, m in self._masters.items() if pid in param_ids and m.grad is not None
        ]
        if grads:
            torch._foreach_mul_(grads, coef)
        for pid in param_ids:
            if pid in self.device_norms:
                self.device_norms[pid] = self.device_norms[pid] * coef

    def clamp_(self, clip_value: float, param_ids: set[int]) -> None:
        """Clamp the host gradients of ``param_ids`` to ``[-clip_value, clip_value]``
        (``clip_grad_value_``); their norms taken on the device no longer hold."""
        self._early.check_no_early_update("clip_grad_value_")
        self.host_grads()  # a pending clipping coefficient first
        grads = [
            m.grad for pid, m in self._masters.items() if pid in param_ids and m.grad is not None
        ]
        for grad in grads:
            grad.clamp_(-clip_value, clip_value)
        for pid in param_ids:
            self.device_norms.pop(pid, None)
