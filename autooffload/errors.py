"""The exception types autooffload raises; every one names the setting, its value and the fix."""

from __future__ import annotations


class AutoOffloadError(RuntimeError):
    """Base class of every error autooffload raises on purpose."""


class SettingsError(AutoOffloadError, ValueError):
    """A setting (kwarg or ``AUTOOFFLOAD_*`` env var) has an invalid value."""


class AttachError(AutoOffloadError):
    """A model or optimizer cannot be attached as asked (unsupported structure or class)."""


class PlanError(AutoOffloadError):
    """No plan fits the budget, or a user override is infeasible."""


class UpdateInBackwardError(AutoOffloadError):
    """``AUTOOFFLOAD_UPDATE_IN_BACKWARD=1`` updated a chunk during backward, and the training
    loop then did something only an update at ``step()`` could honour (clipping, accumulation,
    a skipped step, changed hyperparameters)."""


class UnsupportedAutogradError(AutoOffloadError):
    """User code asked autograd for something an attached model's offloaded weights cannot
    take part in (a backward with ``create_graph=True``: double backward, gradient penalty)."""


class DetachStateError(AutoOffloadError):
    """The model was detached whole, but the optimizer state of its offloaded parameters could
    not be handed to the user's optimizer on the detach device (it does not fit there)."""


class OutOfStepError(AutoOffloadError):
    """Data-parallel ranks under sharded model states started different forwards or backwards,
    or issued different chunk collectives (``runtime/parallel/lockstep.py``)."""


class MissingExtraError(AutoOffloadError, ImportError):
    """A feature needs an optional dependency that is not installed (QLoRA: bitsandbytes, the
    ``autooffload[qlora]`` extra)."""


class HostMemoryError(AutoOffloadError):
    """Host memory ran short while training: pinning more for activations kept on the host would
    leave the machine too little (the kernel's out-of-memory kill would follow)."""
