"""Replay the step check of a calibration on autooffload runs recorded in bench JSON (dev tool).

python devtools/replay_calibration.py results.json [...]

Each autooffload run's JSON holds the profile and hardware its last plan was searched with, the
plan's knobs and GPU update split, the budget and the timed steps' median. This rebuilds the
running plan from them, hands the median to ``replan.calibrated`` as a window's measured step
(the peak as predicted, the rates as planned), and prints what the check concludes with the
code as it is now: the calibration's words and the plan it would switch to, or that it keeps
the running one.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from autooffload.errors import PlanError
from autooffload.plan import replan
from autooffload.plan.profile_types import HardwareProfile, ModelProfile
from autooffload.plan.search import SearchRequest

GiB = 1 << 30
KNOBS = ("n_persist", "n_buffer", "n_swap", "n_checkpoint")


def running_plan(run: dict, request: SearchRequest):
    """The run's last plan, searched again at its knobs and its GPU update split."""
    profile = next(iter(request.profiles_by_chunk_size.values()))
    breakdown = run.get("predicted_breakdown") or {}
    split = int(breakdown.get("gpu_backward_chunks") or 0)
    at_step = int(breakdown.get("gpu_update_chunks") or 0)
    if profile.update_in_backward and profile.gpu_update_in_backward < 0:
        profile = dataclasses.replace(profile, gpu_update_in_backward=split)
    elif not profile.update_in_backward and profile.gpu_update < 0:
        profile = dataclasses.replace(profile, gpu_update=at_step)
    fixed = {name: run["plan"][name] for name in KNOBS if name in run["plan"]}
    pinned = dataclasses.replace(
        request, profiles_by_chunk_size={profile.chunk_size: profile}, fixed=fixed
    )
    return pinned.plan()


def replay(path: str) -> None:
    with open(path) as f:
        data = json.load(f)
    for run in data.get("runs", []):
        if run.get("peer") != "autooffload" or not run.get("model_profile"):
            continue
        label = run.get("peer_label") or run["peer"]
        profile = ModelProfile.from_dict(run["model_profile"])
        hw = HardwareProfile.from_dict(run["hardware"])
        budget = int(run["candidates"]["budget_gib"] * GiB)
        request = SearchRequest({profile.chunk_size: profile}, hw, budget)
        try:
            plan = running_plan(run, request)
        except PlanError as error:
            print(f"{path.split('/')[-1]} {label}: the running plan does not rebuild ({error})")
            continue
        measured = replan.Measured(int(plan.predicted_peak_bytes), step_s=run["step_s_median"])
        found = replan.calibrated(plan, request, profile, profile.chunk_size, measured)
        print(
            f"{path.split('/')[-1]} {label}: predicted {plan.predicted_step_s * 1e3:.0f} ms"
            f" (recorded {run['predicted_step_s'] * 1e3:.0f}), measured"
            f" {run['step_s_median'] * 1e3:.0f} ms"
        )
        if found is None:
            print("  the check finds nothing to calibrate")
        elif isinstance(found.outcome, str):
            print(f"  {found.what}; no plan fits: {found.outcome}")
        elif found.outcome.configures_like(plan):
            print(f"  {found.what}; the plan stays")
        else:
            print(f"  {found.what}; re-planned:\n{found.outcome.summary('cuda')}")


if __name__ == "__main__":
    for argument in sys.argv[1:]:
        replay(argument)
