"""OpenMP's wait policy, for the CPU optimizer's threads (``OMP_WAIT_POLICY``).

The CPU optimizer runs its updates on a worker thread with a team of OpenMP threads. After each
parallel region libgomp (torch's OpenMP) keeps the team spinning for a while before it sleeps.
An update is a string of short regions, so with the default policy those threads spin through
most of the forward and the backward beside it, on the cores the thread launching the GPU's
kernels and autograd's thread need: on the H100's 16-core host the 1.1B model's checkpointed
backward took 107-131 ms per step against 92 ms with ``OMP_WAIT_POLICY=PASSIVE`` (and the CPU
update ran no slower). libgomp reads the variable once, when torch loads it, so ``enable()``
sets it only while torch is not imported yet; later, a warning says what to do.
"""

from __future__ import annotations

import os
import sys

from autooffload.log import warn_once

ENV = "OMP_WAIT_POLICY"


def prefer_passive() -> None:
    """Ask for passive waiting if torch (and its OpenMP runtime) is not loaded yet and the
    user chose no policy: ``python -m autooffload`` and scripts enabling before ``import torch``."""
    if ENV not in os.environ and "torch" not in sys.modules:
        os.environ[ENV] = "PASSIVE"


def warn_if_spinning() -> None:
    """Once: the OpenMP runtime was loaded with no wait policy, so its idle threads spin."""
    if ENV in os.environ:
        return  # PASSIVE, or a policy the user chose
    warn_once(
        "omp-wait-policy",
        "autooffload: torch was imported before autooffload.enable() with OMP_WAIT_POLICY unset,"
        " so the CPU optimizer's idle OpenMP threads spin beside the threads launching the GPU's"
        " kernels (a 1.1B step: 10-20% slower); set OMP_WAIT_POLICY=PASSIVE in the environment,"
        " or run the script with python -m autooffload",
    )
