"""Fixtures for the planner tests: synthetic profiles (no GPU, no real model)."""

from __future__ import annotations

import pytest
from plan_profiles import make_hardware, make_profile

from autooffload.plan.profile_types import HardwareProfile, ModelProfile


@pytest.fixture
def hw() -> HardwareProfile:
    return make_hardware()


@pytest.fixture
def profile() -> ModelProfile:
    return make_profile()
