"""Where a training step stands: one phase enum and the step's counters, changed by methods only.

The phase answers what the group hooks must do now, as FSDP2's ``TrainingState`` does:

- ``IDLE``: no backward of this model is running; forwards (with or without grad) run here.
- ``BACKWARD``: a backward registered its end callback (``backward_task``) and has not reached
  it. Still ``BACKWARD`` once autograd is no longer running is an interrupted backward, which
  ``StepHooks.recover_interrupted`` cleans up.
- ``PROBE``: the profiler runs one block through its ``__call__`` alone; the groups' hooks step
  aside (the probe gathers the chunks itself and keeps no trace).

The counters: optimizer steps since attach, backward passes since attach (each chunk's
gradients are reduced once per backward) and in this step (gradient accumulation's micro
batches), and whether ``zero_grad()`` ran since the last step.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import contextmanager


class StepPhase(enum.Enum):
    IDLE = "idle"
    BACKWARD = "backward"
    PROBE = "probe"


class StepState:
    """The phase of one runtime's step and its counters; only its methods change them."""

    def __init__(self) -> None:
        self._phase = StepPhase.IDLE
        self._backward_task: int | None = None
        self._steps = 0
        self._backwards = 0
        self._backwards_this_step = 0
        self._cleared_since_step = True

    @property
    def phase(self) -> StepPhase:
        return self._phase

    @property
    def hooks_muted(self) -> bool:
        """Whether the groups' hooks step aside (a profiling probe runs a block alone)."""
        return self._phase is StepPhase.PROBE

    @property
    def backward_task(self) -> int | None:
        """The autograd graph task of the backward under way (None between backwards)."""
        return self._backward_task

    @property
    def steps(self) -> int:
        """Optimizer steps since attach."""
        return self._steps

    @property
    def backwards(self) -> int:
        """Backward passes begun since attach (the id of the latest)."""
        return self._backwards

    @property
    def backwards_this_step(self) -> int:
        """Backward passes completed since the last optimizer step."""
        return self._backwards_this_step

    @property
    def cleared_since_step(self) -> bool:
        """Whether ``zero_grad()`` ran since the last optimizer step."""
        return self._cleared_since_step

    def is_new_backward(self, task: int) -> bool:
        """Whether autograd graph task ``task`` is a backward not begun here yet."""
        return task != self._backward_task

    def begin_backward(self, task: int) -> int:
        """Backward ``task`` starts; returns its id (backwards since attach)."""
        self._backward_task = task
        self._backwards += 1
        if self._phase is not StepPhase.PROBE:
            self._phase = StepPhase.BACKWARD
        return self._backwards

    def end_backward(self) -> None:
        """The backward reached its end callback: one more micro-batch in this step."""
        self._drop_backward()
        self._backwards_this_step += 1

    def interrupted_backward(self, running: bool) -> bool:
        """Whether a backward begun here never reached its end (``running``: whether autograd
        runs a backward on this thread now)."""
        return self._backward_task is not None and not running

    def abandon_backward(self) -> None:
        """An interrupted backward was cleaned up: none is under way."""
        self._drop_backward()

    def _drop_backward(self) -> None:
        self._backward_task = None
        if self._phase is StepPhase.BACKWARD:
            self._phase = StepPhase.IDLE

    def cleared(self) -> None:
        """``zero_grad()`` ran."""
        self._cleared_since_step = True

    def end_step(self) -> int:
        """An optimizer step: returns the backward passes it took (and starts the next)."""
        backwards, self._backwards_this_step = self._backwards_this_step, 0
        self._steps += 1
        self._cleared_since_step = False
        return backwards

    @contextmanager
    def probe(self) -> Iterator[None]:
        """The phase ``PROBE`` for the block, then the phase before it."""
        self._phase = StepPhase.PROBE
        try:
            yield
        finally:
            self._phase = StepPhase.IDLE if self._backward_task is None else StepPhase.BACKWARD
