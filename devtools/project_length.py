"""The plan a recorded autooffload bench run's model would get at another sequence length
(dev tool).

Reads a run's ``search_request`` and ``hardware`` from bench JSON (recorded since the bench
kept the search request), scales the measured profile to ``--seq`` positions
(``ModelProfile.with_sequence_scaled``: blocks probed on slices of a long batch by their fit,
attention's time quadratic; the rest linearly) and searches it under ``--cap`` (the runtime's
budget margin taken off) and ``--host-room`` (default: the run's). A prediction from a shorter
run, not a measurement: profile at the longer length to verify.

    python devtools/project_length.py results.json --seq 524288 --cap 78GiB --host-room 1TiB
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from autooffload.bench.peer_autooffload import search_request_from_dict
from autooffload.errors import PlanError
from autooffload.plan.profile_types import ModelProfile
from autooffload.runtime.control.planning import BUDGET_MARGIN_MIN, BUDGET_MARGIN_SHARE
from autooffload.setting_values import parse_size_or_fraction

GiB = 1 << 30


def scaled_profiles(run: dict, seq: int) -> dict[int, ModelProfile]:
    """``run``'s profiles (by chunk size) scaled to ``seq`` positions."""
    request = search_request_from_dict(run["search_request"], run["hardware"])
    ratio = seq / run["seq"]
    return {
        size: profile.with_sequence_scaled(ratio)
        for size, profile in request.profiles_by_chunk_size.items()
    }


def with_units_of(profile: ModelProfile, other: ModelProfile) -> ModelProfile:
    """``profile`` with ``other``'s block, embedding and head/loss units (both at the same
    length; ``other`` a shallower model of the same block shape: its blocks repeat)."""
    mine, theirs = profile.blocks[0], other.blocks[0]
    if abs(mine.act_bytes_checkpoint - theirs.act_bytes_checkpoint) > 0.01 * max(
        1, mine.act_bytes_checkpoint
    ):
        raise SystemExit(
            "--units-from: the other run's block input is"
            f" {theirs.act_bytes_checkpoint} bytes at this length, this run's"
            f" {mine.act_bytes_checkpoint}: not the same block shape and batch"
        )
    n = len(other.blocks)
    blocks = tuple(
        replace(other.blocks[i % n], name=unit.name) for i, unit in enumerate(profile.blocks)
    )
    return replace(profile, blocks=blocks, pre=other.pre, post=other.post)


def project(
    run: dict, seq: int, cap: int, host_room: int | None, units_from: dict | None = None
) -> str:
    """The summary of the plan ``run``'s model gets at ``seq`` positions under ``cap``
    (its units ``units_from``'s where given)."""
    request = search_request_from_dict(run["search_request"], run["hardware"])
    profiles = scaled_profiles(run, seq)
    if units_from is not None:
        others = scaled_profiles(units_from, seq)
        profiles = {
            size: with_units_of(profile, others.get(size, next(iter(others.values()))))
            for size, profile in profiles.items()
        }
    budget = cap - max(BUDGET_MARGIN_MIN, int(BUDGET_MARGIN_SHARE * cap))
    room = request.host_room if host_room is None else host_room
    scaled = replace(
        request,
        profiles_by_chunk_size=profiles,
        budget_bytes=budget,
        host_room=room,
        # The blocks' inputs go to the host as far as the room holds them.
        host_input_blocks=None,
    )
    plan = scaled.plan()
    tokens = next(iter(profiles.values())).batch_tokens
    return (
        f"{plan.summary('cuda')}\n  host activations {plan.host_activation_bytes / GiB:.1f} GiB"
        f" (room {room / GiB if room is not None else float('inf'):.1f}),"
        f" {tokens / plan.predicted_step_s:.0f} tok/s predicted"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json")
    parser.add_argument("--seq", type=int, required=True, help="positions to project to")
    parser.add_argument("--cap", required=True, help="device cap, e.g. 78GiB")
    parser.add_argument("--host-room", help="host bytes for activations (default: the run's)")
    parser.add_argument(
        "--units-from",
        help="bench JSON of the same block shape at another depth: its units replace the run's",
    )
    args = parser.parse_args()
    units_from = None
    if args.units_from:
        with open(args.units_from) as f:
            units_from = next(
                (
                    r
                    for r in json.load(f).get("runs", [])
                    if r.get("peer") == "autooffload" and r.get("search_request")
                ),
                None,
            )
        if units_from is None:
            parser.error(
                f"--units-from {args.units_from}: no autooffload run with a search request"
            )
    cap = int(parse_size_or_fraction(args.cap, "cap"))
    room = int(parse_size_or_fraction(args.host_room, "host-room")) if args.host_room else None
    with open(args.json) as f:
        data = json.load(f)
    for run in data.get("runs", []):
        if run.get("peer") != "autooffload" or not run.get("search_request"):
            continue
        label = f"{run['workload']} seq {run['seq']} -> {args.seq}, cap {args.cap}"
        try:
            print(f"{label}:\n{project(run, args.seq, cap, room, units_from)}")
        except PlanError as error:
            print(f"{label}: no plan fits: {error}")


if __name__ == "__main__":
    main()
