"""Ranks in step under sharded model states: a clear error instead of mis-paired collectives.

Under sharding (runtime/parallel/sharding.py) each offloaded chunk's bytes live on one rank, and
every gather, in a forward or a backward, is a broadcast from that owner. Collectives pair by their
order alone, so a forward that runs on some ranks only (``if rank == 0: model.generate(...)``,
an extra eval batch on one rank) pairs its broadcasts with the other ranks' next ones: those of
a training forward (the right chunks, by luck of the same order), then of a backward (other
chunks, in the other order). Where two such broadcasts share their root, bytes of one chunk land
in another's storage and training goes on with wrong weights, silently; otherwise the job hangs.

So at the start of each forward and each backward of an attached model whose plan gathers
sharded chunks, the ranks exchange what they are starting (a forward with gradients, one
without, a backward) over a gloo group of their own, which no other collective uses, so the
exchange can only pair with another rank's exchange. Ranks starting different things all raise
the same error, before any gather. A rank whose peers never start anything (they wait in a
barrier while it evaluates alone) warns after ``STALL_WARNING_S`` and raises at the process
group's timeout.

The exchange also carries a hash of the chunk collectives (gathers and gradient reduces, by
chunk) each rank issued since the last one. A module that runs on some ranks only inside a
forward shifts the others' collectives: where the shifted ones still pair up (same root), the
bytes of one chunk were received as another's; the hashes differ at the next exchange and every
rank raises there, one forward or backward late (the end of each backward exchanges too, so
before ``optimizer.step()``; an update in the backward may have applied a wrong gradient by
then, and the error stops the run). Where they do not pair up, the job fails in the collective
(a size mismatch, or the timeout).

Cost: one small host all-gather at each forward's start and each backward's start and end
(~0.1-0.5 ms over loopback TCP), beside the chunk broadcasts of the same forward.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch
import torch.distributed as dist

from autooffload.errors import OutOfStepError
from autooffload.log import warn_once

# Seconds a rank waits for its peers at a forward or backward before it warns (once).
STALL_WARNING_S = 60.0

FORWARD_WITH_GRAD, FORWARD_NO_GRAD, BACKWARD, BACKWARD_END = 0, 1, 2, 3
PHASES = {
    FORWARD_WITH_GRAD: "a forward with gradients (training)",
    FORWARD_NO_GRAD: "a forward without gradients (eval or generate)",
    BACKWARD: "a backward",
    BACKWARD_END: "the end of a backward",
}
_MASK = (1 << 62) - 1
FIX = (
    "under sharded model states (AUTOOFFLOAD_SHARD_OPTIMIZER=auto or on) each offloaded"
    " chunk's weights live on one rank and every forward and backward gathers them from it,"
    " so every rank must run the same forwards and backwards: evaluate or generate on every"
    " rank (each on its part of the data, as Trainer.evaluate does), or set"
    " AUTOOFFLOAD_SHARD_OPTIMIZER=off (every rank keeps every chunk)"
)


# (the default group it was made for, the gloo group): one per process, made at attach.
_group: tuple[Any, Any] | None = None


def group_timeout(group: Any = None) -> datetime.timedelta | None:
    """The timeout ``group`` (the default group if None) was created with, or None (torch's
    default) where this torch does not expose it."""
    group = dist.group.WORLD if group is None else group
    device = torch.device("cuda" if "nccl" in str(dist.get_backend(group)) else "cpu")
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


def lockstep_group() -> Any:
    """Collective on first use (in a process group's life): the gloo group of the exchange,
    over the default group's ranks, with its timeout."""
    global _group
    world = dist.group.WORLD
    if _group is None or _group[0] is not world:
        _group = (world, dist.new_group(backend="gloo", timeout=group_timeout(world)))
    return _group[1]


class Lockstep:
    """The start-of-phase exchange of one data-parallel runtime under sharded state."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = lockstep_group()
        self.exchanges = 0
        # Hash of the chunk collectives issued since the last exchange, and their count.
        self.sequence = 0
        self.count = 0

    def issued(self, key: int) -> None:
        """A chunk collective was issued (``key``: the chunk's gather, or ``-1 - index`` for
        its gradient reduce)."""
        self.sequence = (self.sequence * 1_000_003 + key + 7) & _MASK
        self.count += 1

    def check(self, phase: int) -> None:
        """Collective: every rank starts ``phase`` (a key of ``PHASES``) having issued the same
        chunk collectives since the last check, or all raise the same error."""
        mine = torch.tensor([phase, self.sequence, self.count], dtype=torch.int64)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        work = dist.all_gather(gathered, mine, group=self.group, async_op=True)
        self._wait(work, phase)
        self.exchanges += 1
        self.sequence = self.count = 0
        phases = [int(t[0]) for t in gathered]
        if len(set(phases)) > 1:
            ranks = "; ".join(f"rank {r}: {PHASES.get(p, p)}" for r, p in enumerate(phases))
            raise OutOfStepError(f"autooffload: the ranks are out of step ({ranks}); {FIX}")
        if len({(int(t[1]), int(t[2])) for t in gathered}) > 1:
            counts = ", ".join(f"rank {r}: {int(t[2])}" for r, t in enumerate(gathered))
            raise OutOfStepError(
                "autooffload: the ranks issued different chunk gathers or gradient reduces"
                f" before {PHASES.get(phases[0])} ({counts}), so some paired with the wrong"
                " chunk's: a module ran on some ranks only (data-dependent control flow)."
                " Under sharded model states (AUTOOFFLOAD_SHARD_OPTIMIZER=auto or on) every"
                " rank must run the same modules; set AUTOOFFLOAD_SHARD_OPTIMIZER=off for"
                " such a model (replicated state pairs the reduces of modules some ranks skip)"
            )

    def _wait(self, work: Any, phase: int) -> None:
        """Wait for the exchange, polling, so that a long wait can warn before the timeout."""
        start = time.perf_counter()
        delay = 0.0  # first 1 ms: yield the GIL and look again; then back off to 10 ms
        warned = False
        while not work.is_completed():
            time.sleep(delay)
            waited = time.perf_counter() - start
            if waited > 1e-3:
                delay = min(2 * max(delay, 5e-5), 0.01)
            if not warned and waited > STALL_WARNING_S:
                warned = True
                warn_once(
                    "lockstep-stall",
                    f"autooffload: rank {self.rank} has waited {waited:.0f} s for the other"
                    f" ranks to start {PHASES[phase]} too; if they are not running the model"
                    f" now, this ends in an error at the process group's timeout: {FIX}",
                )
        try:
            work.wait()
        except RuntimeError as error:
            if "timed out" not in str(error).lower() and "timeout" not in str(error).lower():
                raise  # a peer's crash or exit: its own error is the one to read
            raise OutOfStepError(
                f"autooffload: rank {self.rank} waited {time.perf_counter() - start:.0f} s (the"
                f" process group's timeout) for the other ranks to start {PHASES[phase]}"
                " too: another rank failed or hangs (read its log), or it runs something"
                f" else; {FIX}"
            ) from error
