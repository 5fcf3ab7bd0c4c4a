"""A token-by-token reference of the scanner and the label masker, written from their docstrings.

Plain Python over lists, one row at a time: slow, but each rule is one readable line, so the
vectorised code in ``autooffload.masking`` can be compared with it on random batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from autooffload.masking import IGNORE_INDEX, MaskingOptions, RoleBoundary


@dataclass(frozen=True)
class RefTurn:
    row: int
    boundary: int
    start: int
    content_start: int
    content_end: int
    end: int
    closed: bool


def _matches(row: Sequence[int], at: int, marker: tuple[int, ...]) -> bool:
    return at + len(marker) <= len(row) and tuple(row[at : at + len(marker)]) == marker


def ref_turns(boundaries: Sequence[RoleBoundary], ids: list[list[int]]) -> list[RefTurn]:
    """Every turn, by row and column: the longest start marker opens a turn (ties: the smaller
    marker, then the smaller boundary); at each position only the longest end marker counts."""
    starts = sorted(
        {(tuple(m), b) for b, boundary in enumerate(boundaries) for m in boundary.starts if m},
        key=lambda item: (-len(item[0]), item),
    )
    ends = sorted({tuple(m) for b in boundaries for m in b.ends if m}, key=lambda m: (-len(m), m))
    closes = [{tuple(m) for m in b.ends} for b in boundaries]
    turns = []
    for r, row in enumerate(ids):
        opened = []  # (column, marker, boundary)
        end_at = {}  # column -> the longest end marker there
        for column in range(len(row)):
            found = [(m, b) for m, b in starts if _matches(row, column, m)]
            if found:
                opened.append((column, *found[0]))
            found_ends = [m for m in ends if _matches(row, column, m)]
            if found_ends:
                end_at[column] = found_ends[0]
        for k, (column, marker, b) in enumerate(opened):
            content_start = column + len(marker)
            bound = opened[k + 1][0] if k + 1 < len(opened) else len(row)
            # The first end closing this boundary at or after the contents, at or before the next
            # start (an end and a start at one position: the end is handled first).
            close = next(
                (q for q in sorted(end_at) if q >= content_start and end_at[q] in closes[b]), None
            )
            if close is not None and close <= bound:
                turns.append(
                    RefTurn(r, b, column, content_start, close, close + len(end_at[close]), True)
                )
            else:
                turns.append(RefTurn(r, b, column, content_start, bound, bound, False))
    return turns


def _union(spans: list[tuple[int, int]], n: int) -> list[bool]:
    """Covered where more spans have opened than closed (a reversed span counts -1 inside)."""
    return [sum((s <= t) - (e <= t) for s, e in spans) > 0 for t in range(n)]


def ref_scan(
    boundaries: Sequence[RoleBoundary], options: MaskingOptions, ids: list[list[int]]
) -> dict:
    """Per row: has_chat, trained, trained end markers, assistant contents, marker tokens and
    the tokens of turns."""
    turns = ref_turns(boundaries, ids)
    roles = set(options.roles_to_train)
    out: dict = {
        "has_chat": [],
        "trained": [],
        "end_markers": [],
        "content": [],
        "markers": [],
        "in_turns": [],
    }
    for r, row in enumerate(ids):
        own = [t for t in turns if t.row == r]
        n = len(row)
        is_trained = [boundaries[t.boundary].role in roles for t in own]
        mode = options.train_on_eos
        eos = [
            t.closed
            and boundaries[t.boundary].include_end
            and (is_trained[k] if mode in ("turn", "last") else mode == "all")
            for k, t in enumerate(own)
        ]
        if mode == "last":
            final = max((k for k in range(len(own)) if is_trained[k]), default=None)
            eos = [e and k == final for k, e in enumerate(eos)]
        spans = []
        for k, t in enumerate(own):
            if not (is_trained[k] or eos[k]):
                continue
            first = t.start if boundaries[t.boundary].include_start else t.content_start
            spans.append(
                (first if is_trained[k] else t.content_end, t.end if eos[k] else t.content_end)
            )
        out["has_chat"].append(bool(own))
        if options.train_on_inputs:
            out["trained"].append([bool(own)] * n)
        else:
            out["trained"].append(_union(spans, n))
        ends = [(t.content_end, t.end) for k, t in enumerate(own) if eos[k]]
        out["end_markers"].append(_union(ends, n))
        content = [
            (t.content_start, t.content_end)
            for t in own
            if boundaries[t.boundary].role == "assistant"
        ]
        out["content"].append(_union(content, n))
        start_markers = _union([(t.start, t.content_start) for t in own], n)
        end_markers = _union([(t.content_end, t.end) for t in own], n)
        out["markers"].append([a or b for a, b in zip(start_markers, end_markers)])
        out["in_turns"].append(_union([(t.start, t.end) for t in own], n))
    return out


def ref_mask(
    boundaries: Sequence[RoleBoundary],
    options: MaskingOptions,
    pad_token_id: int | None,
    media_ids: Sequence[int],
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    assistant_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, tuple[int, int]]:
    """``LabelMasker.mask`` token by token: the masked labels and (chat rows, all -100 rows)."""
    squeeze = input_ids.dim() == 1

    def rows_of(tensor: torch.Tensor | None) -> list[list[int]] | None:
        if tensor is None:
            return None
        return (tensor.unsqueeze(0) if squeeze else tensor).tolist()

    ids = rows_of(input_ids)
    if labels is not None and labels.shape != input_ids.shape:
        return labels, (0, 0)
    scan = ref_scan(boundaries, options, ids)
    attention = rows_of(attention_mask)
    starts = [m for b in boundaries for m in b.starts if m]
    for r, row in enumerate(ids):
        # A row without a start marker that ends inside one is a chat cut in its first marker.
        real = attention[r] if attention is not None else [t != pad_token_id for t in row]
        end = max((t + 1 for t, on in enumerate(real) if on), default=0)
        if not scan["has_chat"][r] and any(
            0 < k < len(m) and end >= k and tuple(row[end - k : end]) == m[:k]
            for m in starts
            for k in range(1, len(m))
        ):
            scan["has_chat"][r] = True
            scan["trained"][r] = [options.train_on_inputs] * len(row)
    if not any(scan["has_chat"]):
        return labels, (0, 0)
    base = rows_of(labels) if labels is not None else [list(row) for row in ids]
    generation = rows_of(assistant_mask)
    marker_tokens = {t for b in boundaries for m in (*b.starts, *b.ends) for t in m}
    pad_is_marker = attention is None and pad_token_id in marker_tokens
    out, n_rows, n_empty = [], 0, 0
    for r, row in enumerate(ids):
        trained = scan["trained"][r]
        if generation is not None and scan["has_chat"][r]:
            generated = [
                bool(g) and inside and not m
                for g, inside, m in zip(generation[r], scan["in_turns"][r], scan["markers"][r])
            ]
            uses_it = "assistant" in options.roles_to_train and not options.train_on_inputs
            if uses_it:
                trained = [
                    (t and not c) or g for t, c, g in zip(trained, scan["content"][r], generated)
                ]
        label_row = base[r]
        chat = scan["has_chat"][r]
        foreign = labels is not None and any(
            lab != tok and lab != IGNORE_INDEX for lab, tok in zip(label_row, row)
        )
        if not chat or foreign:
            out.append(list(label_row))
            continue
        ignored = []
        for t, (tok, lab) in enumerate(zip(row, label_row)):
            if attention is not None:
                pad = attention[r][t] == 0
            else:
                pad = tok == pad_token_id and not (pad_is_marker and scan["end_markers"][r][t])
            caller_masked = lab != tok and lab == IGNORE_INDEX
            ignored.append(not trained[t] or pad or tok in media_ids or caller_masked)
        masked = [IGNORE_INDEX if i else lab for i, lab in zip(ignored, label_row)]
        n_rows += 1
        n_empty += all(ignored)
        out.append(masked)
    reference = labels if labels is not None else input_ids
    result = torch.tensor(out, dtype=reference.dtype)
    return (result.squeeze(0) if squeeze else result), (n_rows, n_empty)
