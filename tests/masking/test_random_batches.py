"""The vectorised masker gives the token-by-token reference's labels on random batches.

Random boundaries over a small alphabet, so markers collide, share tokens, are cut by row ends
and sit next to each other; random options, padding, dtypes, attention masks, media ids, pad ids
equal to a marker token, caller -100s and foreign rows.
"""

from __future__ import annotations

import random

import pytest
import torch
from _reference import ref_mask, ref_turns

from autooffload.masking import LabelMasker, MaskingOptions, MaskingStats, RoleBoundary, Scanner

MARKER_TOKENS = range(1, 9)
FILLER = range(20, 26)
ROLES = ("user", "assistant", "system", "tool")


def random_marker(
    rng: random.Random, longest: int = 3, layered: bool = False, end: bool = False
) -> tuple[int, ...]:
    """``layered``: as real templates' markers are, start markers begin with 1 or 2, end
    markers with 3, and their later tokens (4-8) begin none."""
    if layered:
        first = 3 if end else rng.randint(1, 2)
        return (first,) + tuple(rng.randint(4, 8) for _ in range(rng.randint(0, longest - 1)))
    return tuple(rng.choice(MARKER_TOKENS) for _ in range(rng.randint(1, longest)))


def random_boundaries(rng: random.Random) -> tuple[RoleBoundary, ...]:
    boundaries = []
    many = rng.random() < 0.1  # more than 16 markers: looked up 16 at a time
    layered = rng.random() < 0.3
    for _ in range(rng.randint(9, 14) if many else rng.randint(1, 4)):
        n_starts = rng.randint(1, 3 if many else 2)
        starts = tuple(random_marker(rng, 4, layered) for _ in range(n_starts))
        n_ends = rng.choice((0, 1, 1, 2))
        ends = tuple(random_marker(rng, 2, layered, end=True) for _ in range(n_ends))
        boundaries.append(
            RoleBoundary(
                rng.choice(ROLES),
                starts,
                ends,
                include_start=rng.random() < 0.2,
                include_end=rng.random() < 0.8,
            )
        )
    return tuple(boundaries)


def random_options(rng: random.Random) -> MaskingOptions:
    roles = tuple(r for r in ROLES if rng.random() < 0.5)
    mode = rng.choice(("turn", "turn", "last", "all", "none"))
    return MaskingOptions(rng.random() < 0.15, roles, mode)


def random_row(rng: random.Random, boundaries: tuple[RoleBoundary, ...], length: int) -> list[int]:
    """Turns (a start marker, filler, maybe an end marker), stray marker tokens and filler."""
    row: list[int] = []
    while len(row) < length:
        boundary = rng.choice(boundaries)
        kind = rng.random()
        if kind < 0.6:
            row += rng.choice(boundary.starts)
            row += [rng.choice(FILLER) for _ in range(rng.randint(0, 6))]
            if boundary.ends and rng.random() < 0.8:
                row += rng.choice(boundary.ends)
        elif kind < 0.8:
            row.append(rng.choice(MARKER_TOKENS))
        else:
            row += [rng.choice(FILLER) for _ in range(rng.randint(1, 5))]
    return row[:length]


def random_call(rng: random.Random, boundaries: tuple[RoleBoundary, ...]) -> dict:
    """The arguments of one ``mask`` call, and the pad id and media ids of the masker."""
    n_rows, seq = rng.randint(1, 5), rng.randint(1, 40)
    pad = rng.choice((None, 0, 0, rng.choice(MARKER_TOKENS)))
    rows, lengths = [], []
    for _ in range(n_rows):
        length = seq if rng.random() < 0.5 else rng.randint(0, seq)
        row = random_row(rng, boundaries, length) if rng.random() < 0.9 else [21] * length
        fill = [0 if pad is None else pad] * (seq - length)
        rows.append(fill + row if rng.random() < 0.3 else row + fill)
        lengths.append(length)
    dtype = rng.choice((torch.int64, torch.int64, torch.int32))
    input_ids = torch.tensor(rows, dtype=dtype)
    if rng.random() < 0.2:
        input_ids = input_ids.t().contiguous().t()  # strided
    attention_mask = None
    if rng.random() < 0.6:
        attention_mask = torch.tensor(
            [[int(rng.random() < 0.95) for _ in range(seq)] for _ in range(n_rows)]
        )
        if rng.random() < 0.3:
            attention_mask = attention_mask.bool()
    labels = None
    if rng.random() < 0.7:
        labels = input_ids.clone().to(rng.choice((dtype, torch.int64)))
        for r in range(n_rows):
            kind = rng.random()
            if kind < 0.4:  # the caller masked some tokens
                for c in range(seq):
                    if rng.random() < 0.2:
                        labels[r, c] = -100
            elif kind < 0.5:  # not a copy of the ids: pre-shifted or foreign
                labels[r] = torch.roll(labels[r], -1)
        if rng.random() < 0.03:
            labels = labels[:, :-1]  # a different shape: left alone
    assistant_mask = None
    if rng.random() < 0.1:
        assistant_mask = torch.tensor(
            [[int(rng.random() < 0.5) for _ in range(seq)] for _ in range(n_rows)]
        )
    call = {
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": attention_mask,
        "assistant_mask": assistant_mask,
    }
    if n_rows == 1 and rng.random() < 0.3:
        call = {k: None if v is None else v[0] for k, v in call.items()}
    media = tuple(rng.sample((*MARKER_TOKENS, *FILLER), rng.choice((0, 0, 1, 2, 3))))
    # Blocks of "added tokens" at the ends of the vocabulary: found with one compare each.
    special = (rng.choice((0, 0, 3, 9, 21)), rng.choice((None, None, 5, 8, 22, 30)))
    return {"call": call, "pad": pad, "media": media, "special": special}


def check(seed: int) -> None:
    rng = random.Random(seed)
    boundaries, options = random_boundaries(rng), random_options(rng)
    scanner = Scanner(boundaries, options)
    for _ in range(4):
        drawn = random_call(rng, boundaries)
        call, pad, media = drawn["call"], drawn["pad"], drawn["media"]
        stats = MaskingStats()
        masker = LabelMasker(scanner, "random", pad, media, stats, drawn["special"])
        expected, counts = ref_mask(boundaries, options, pad, media, **call)
        got = masker.mask(**call)
        where = f"seed {seed}: {boundaries} {options} pad={pad} media={media} {call}"
        if expected is None:
            assert got is None, where
            continue
        assert got is not None, where
        assert got.dtype == expected.dtype and torch.equal(got, expected), where
        assert (stats.samples, stats.all_masked) == counts, where
        ids = call["input_ids"]
        rows = (ids.unsqueeze(0) if ids.dim() == 1 else ids).tolist()
        turns = [
            (t.row, t.boundary, t.start, t.content_start, t.content_end, t.end, t.closed)
            for t in scanner.turns(ids)
        ]
        expected_turns = [
            (t.row, t.boundary, t.start, t.content_start, t.content_end, t.end, t.closed)
            for t in ref_turns(boundaries, rows)
        ]
        assert turns == expected_turns, where


@pytest.mark.filterwarnings("ignore:masking:UserWarning")  # all -100 samples, generation mismatch
@pytest.mark.parametrize("block", range(8))
def test_random_batches_match_the_reference(block):
    for seed in range(block * 50, (block + 1) * 50):
        check(seed)
