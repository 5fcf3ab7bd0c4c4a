"""The role-boundary scanner: which tokens of a batch of chat token ids belong to trained turns.

A turn is found from token-id markers: it opens at a *start* marker of its boundary and its content
runs until the first *end* marker of that boundary, or the next start marker of any boundary, or the
end of the sequence (a truncated final turn). Shared markers are not consumed: Mistral's ``[/INST]``
both ends a user turn (as its end marker) and starts the assistant turn (as its start marker); at
equal positions end events are handled before start events, so one token can close a turn and open
the next.

The algorithm, on a ``[batch, seq]`` batch seen as one flat row-major array:

1. Candidates, the only full pass of the scan: every token is compared with the first token of
   every marker (one ``==`` per id, ``isin`` for many), and ``flatnonzero`` lists the few hits,
   already sorted by (row, column).
2. Markers: the later tokens of each marker are compared at the candidates only (one gather per
   offset, shared by all markers), longest markers first so a longer alternative wins.
3. Turns: each start marker opens a turn, bounded by the next start in its row; the first end
   marker closing it is found with one ``searchsorted`` per group of end markers that close the
   same boundaries (one group for most templates).
4. Paint: each turn contributes at most one trained span (its contents, followed by its end
   marker when that is trained). The spans become +1/-1 events at flat positions; a running sum
   over the *events* (not the tokens) gives the coverage of each run between two events, and
   ``np.repeat`` writes the runs out as the ``[batch, seq]`` mask in one pass.

The work runs in numpy on the host. On the 32 x 4096 collate batch, single-threaded, torch's CPU
``==`` takes 44 us where numpy's takes 12 us, ``nonzero`` 96 us against 15 us, and each of the
~100 small ops on the candidate arrays costs ~4 us of dispatch in torch against 1-2 us in numpy.
Tensors on an accelerator (only the forward-time catch of hand-written collates sees them) are
copied to the host and the result back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

EOS_MODES = ("turn", "last", "all", "none")


@dataclass(frozen=True)
class RoleBoundary:
    """One kind of turn, at token level.

    Attributes:
        role: The role the turn belongs to (``assistant``, ``user``, ...).
        starts: Token-id sequences that open the turn (alternatives; the longest match wins).
        ends: Token-id sequences that close it (alternatives); empty means the turn runs to the
            next start marker or the end of the sequence.
        include_start: Whether the start marker's tokens are trained with a trained turn.
        include_end: Whether the end marker is this turn's end-of-turn token, trained as
            ``train_on_eos`` says; ``False`` never trains it (e.g. a marker shared with the next
            turn's start).
    """

    role: str
    starts: tuple[tuple[int, ...], ...]
    ends: tuple[tuple[int, ...], ...] = ()
    include_start: bool = False
    include_end: bool = True


@dataclass(frozen=True)
class MaskingOptions:
    """What to train, with the meaning axolotl and TRL users know.

    Attributes:
        train_on_inputs: Train on every token but pad and media placeholders.
        roles_to_train: Roles whose turn contents are trained; empty masks every role.
        train_on_eos: End-of-turn markers trained: ``turn`` (each trained turn's), ``last`` (only
            the final trained turn's), ``all`` (every turn's, trained role or not), ``none``.
    """

    train_on_inputs: bool = False
    roles_to_train: tuple[str, ...] = ("assistant",)
    train_on_eos: str = "turn"

    def __post_init__(self) -> None:
        if self.train_on_eos not in EOS_MODES:
            raise ValueError(f"train_on_eos={self.train_on_eos!r}; valid values: {EOS_MODES}")


@dataclass(frozen=True)
class Turn:
    """One turn found in row ``row``: marker at ``[start, content_start)``, content at
    ``[content_start, content_end)``, end marker at ``[content_end, end)`` (empty when the turn
    was cut by the next turn or by the end of the sequence; ``closed`` is then False)."""

    row: int
    role: str
    boundary: int
    start: int
    content_start: int
    content_end: int
    end: int
    closed: bool


@dataclass
class Turns:
    """The turns of a batch as parallel 1-D host arrays, one entry per turn, ordered by row and
    start: ``row``, ``boundary`` (index), ``closed`` (whether an end marker closed it), and the
    positions ``start``, ``content_start``, ``content_end`` and ``end``, counted in the flattened
    batch (``row * seq_len + column``)."""

    row: np.ndarray
    boundary: np.ndarray
    start: np.ndarray
    content_start: np.ndarray
    content_end: np.ndarray
    end: np.ndarray
    closed: np.ndarray


@dataclass
class HostScan:
    """What the scanner found in a ``[batch, seq]`` batch, as host (numpy) arrays.

    ``trained`` marks trained tokens of rows with chat markers (all False in other rows);
    ``has_chat`` marks rows with at least one start marker; ``end_markers`` marks trained
    end-marker tokens (when asked for); ``assistant_content`` and ``markers`` (every marker
    token) are filled only when the scan was asked for details.
    """

    trained: np.ndarray
    has_chat: np.ndarray
    end_markers: np.ndarray | None
    turns: Turns
    assistant_content: np.ndarray | None = None
    markers: np.ndarray | None = None


@dataclass
class ScanResult:
    """``HostScan``'s masks as tensors on the device of the scanned batch (``turns`` stays on
    the host)."""

    trained: torch.Tensor
    has_chat: torch.Tensor
    end_markers: torch.Tensor | None
    turns: Turns
    assistant_content: torch.Tensor | None = None
    markers: torch.Tensor | None = None


# Up to this many ids, one ``==`` per id (12 us each on 32 x 4096) beats ``np.isin`` (~130 us).
_FEW_IDS = 8


def host_array(tensor: torch.Tensor) -> np.ndarray:
    """A C-contiguous numpy array with the values of ``tensor`` (a view for host tensors)."""
    return np.ascontiguousarray(tensor.detach().cpu().numpy())


def isin_ids(values: np.ndarray, ids: Sequence[int]) -> np.ndarray:
    """A bool array: which of ``values`` are one of the token ``ids``."""
    if not ids or len(ids) > _FEW_IDS:
        return np.isin(values, ids)
    found = values == ids[0]
    for token_id in ids[1:]:
        found |= values == token_id
    return found


class Scanner:
    """Finds the turns of token-id batches for a fixed set of boundaries and options."""

    def __init__(self, boundaries: tuple[RoleBoundary, ...], options: MaskingOptions) -> None:
        self.boundaries = boundaries
        self.options = options
        # Longest markers first, so a longer alternative wins over its prefix at the same place.
        starts = {(tuple(m), i) for i, b in enumerate(boundaries) for m in b.starts if m}
        self._starts = sorted(starts, key=lambda item: (-len(item[0]), item))
        ends = {tuple(m) for b in boundaries for m in b.ends if m}
        self._ends = sorted(ends, key=lambda m: (-len(m), m))
        # End markers grouped by the boundaries they close: (marker indices, closes[b] or None
        # when the group closes every boundary).
        by_closed: dict[tuple[bool, ...], list[int]] = {}
        for k, end in enumerate(self._ends):
            closed = tuple(end in {tuple(m) for m in b.ends} for b in boundaries)
            by_closed.setdefault(closed, []).append(k)
        self._end_groups = [
            (np.array(group), None if all(closed) else np.array(closed))
            for closed, group in by_closed.items()
        ]
        self._anchor_ids = sorted({m[0] for m, _ in self._starts} | {m[0] for m in self._ends})
        markers = [m for m, _ in self._starts] + self._ends
        self.marker_token_ids = frozenset(t for m in markers for t in m)
        # Every marker as a row of a table (start markers, then end markers): its tokens padded
        # with -1, and which offsets lie past its end (those match anything).
        longest = max((len(m) for m in markers), default=1)
        self._marker_tokens = np.array([m + (-1,) * (longest - len(m)) for m in markers] or [[]])
        self._marker_tokens = self._marker_tokens.reshape(len(markers), longest)
        self._past_end = self._marker_tokens < 0
        self._marker_length = np.array([len(m) for m in markers], dtype=np.int64)
        self._start_boundary = np.array([b for _, b in self._starts], dtype=np.int64)
        trained_roles = set(options.roles_to_train)
        self._role_trained = np.array([b.role in trained_roles for b in boundaries], dtype=bool)
        self._include_start = np.array([b.include_start for b in boundaries], dtype=bool)
        self._include_end = np.array([b.include_end for b in boundaries], dtype=bool)
        self._assistant = np.array([b.role == "assistant" for b in boundaries], dtype=bool)
        self._every_end_included = bool(self._include_end.all())
        self._some_start_included = bool(self._include_start.any())

    def find_turns(self, input_ids: torch.Tensor | np.ndarray) -> Turns:
        """Every turn of a ``[batch, seq]`` batch, found with array ops over marker candidates."""
        ids = input_ids if isinstance(input_ids, np.ndarray) else host_array(input_ids)
        seq_len = ids.shape[1]
        flat = ids.reshape(-1)
        at = np.flatnonzero(isin_ids(flat, self._anchor_ids))  # sorted by (row, column)
        rows, columns = np.divmod(at, seq_len)
        # hits[m, c]: marker m is at candidate c. The tokens after the candidates are gathered
        # once per offset for all markers; a marker longer than what is left of its row misses.
        hits = self._marker_tokens[:, :1] == flat[at]
        for offset in range(1, self._marker_tokens.shape[1]):
            following = np.take(flat, at + offset, mode="clip")
            hits &= (self._marker_tokens[:, offset, None] == following) | self._past_end[
                :, offset, None
            ]
        hits &= self._marker_length[:, None] <= seq_len - columns
        n_starts = len(self._starts)
        start_marker = _first_hit(hits[:n_starts])
        is_start = np.flatnonzero(start_marker >= 0)  # indices: cheaper than a bool mask twice
        start, start_marker, row = at[is_start], start_marker[is_start], rows[is_start]
        boundary = self._start_boundary[start_marker]
        content_start = start + self._marker_length[start_marker]
        row_end = (row + 1) * seq_len
        # The next start in the same row bounds each turn, else the end of the row.
        bound = row_end.copy()
        bound[:-1] = np.minimum(start[1:], row_end[:-1])
        # The first end marker closing this boundary at or after the content start (later rows
        # included: those are rejected below), searched once per group of end markers that
        # close the same boundaries (one group for most templates).
        no_end = flat.size + 1
        end_at = np.full_like(start, no_end)
        end_length = np.zeros_like(start)
        end_marker = _first_hit(hits[n_starts:])
        for group, closes in self._end_groups:
            is_end = np.flatnonzero(
                np.isin(end_marker, group) if group.size > 1 else end_marker == group[0]
            )
            ends = np.append(at[is_end], no_end)  # the sentinel: no end after this
            lengths = np.append(self._marker_length[n_starts + end_marker[is_end]], 0)
            index = np.searchsorted(ends, content_start)  # sorted keys: ~15 us
            first = ends[index]
            better = first < end_at if closes is None else closes[boundary] & (first < end_at)
            end_at = np.where(better, first, end_at)
            end_length = np.where(better, lengths[index], end_length)
        # At equal positions the end marker wins: [/INST] closes the user turn, then opens the
        # next; an end past the row's last token is in another row.
        closed = end_at <= np.minimum(bound, row_end - 1)
        content_end = np.where(closed, end_at, bound)
        end = np.where(closed, end_at + end_length, content_end)
        return Turns(row, boundary, start, content_start, content_end, end, closed)

    def turns(self, input_ids: torch.Tensor) -> list[Turn]:
        """Every turn of every row as ``Turn`` records, with positions as columns (for debugging
        and tests)."""
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        found = self.find_turns(input_ids)
        row_start = found.row * input_ids.shape[1]
        columns = zip(
            found.row.tolist(),
            found.boundary.tolist(),
            (found.start - row_start).tolist(),
            (found.content_start - row_start).tolist(),
            (found.content_end - row_start).tolist(),
            (found.end - row_start).tolist(),
            found.closed.tolist(),
        )
        return [
            Turn(row, self.boundaries[b].role, b, start, c_start, c_end, end, closed)
            for row, b, start, c_start, c_end, end, closed in columns
        ]

    def scan(
        self, input_ids: torch.Tensor, details: bool = False, end_markers: bool = False
    ) -> ScanResult:
        """Scan a ``[batch, seq]`` (or ``[seq]``) tensor of token ids; ``end_markers`` also
        paints the trained end markers on their own, ``details`` the assistant contents and
        every marker token."""
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        found = self.scan_host(host_array(input_ids), details, end_markers)

        def tensor(array: np.ndarray | None) -> torch.Tensor | None:
            return None if array is None else torch.from_numpy(array).to(input_ids.device)

        return ScanResult(
            tensor(found.trained),
            tensor(found.has_chat),
            tensor(found.end_markers),
            found.turns,
            tensor(found.assistant_content),
            tensor(found.markers),
        )

    def scan_host(
        self, input_ids: np.ndarray, details: bool = False, end_markers: bool = False
    ) -> HostScan:
        """``scan`` on a ``[batch, seq]`` numpy array, with numpy results."""
        shape = input_ids.shape
        turns = self.find_turns(input_ids)
        has_chat = np.zeros(shape[0], dtype=bool)
        has_chat[turns.row] = True
        role_trained = self._role_trained[turns.boundary]
        mode = self.options.train_on_eos
        eos = turns.closed & role_trained if mode == "turn" else turns.closed.copy()
        if not self._every_end_included:  # the table lookups cost ~2 us each: skip when uniform
            eos &= self._include_end[turns.boundary]
        if mode == "last":
            trained_at = np.flatnonzero(role_trained)
            trained_rows = turns.row[trained_at]
            # Turns are ordered by row: a row's final trained turn is followed by another row's.
            final = np.ones(trained_at.size, dtype=bool)
            final[:-1] = trained_rows[1:] != trained_rows[:-1]
            is_final = np.zeros_like(eos)
            is_final[trained_at[final]] = True
            eos &= is_final
        elif mode == "none":
            eos[:] = False
        painted_ends = None
        if end_markers or details:
            painted_ends = _paint(turns.content_end[eos], turns.end[eos], shape)
        if self.options.train_on_inputs:
            trained = np.repeat(has_chat, shape[1]).reshape(shape)
        else:
            first = turns.content_start
            if self._some_start_included:
                first = np.where(self._include_start[turns.boundary], turns.start, first)
            # A turn's contents [first, content_end) and its trained end marker
            # [content_end, end) are adjacent: one span per turn paints both.
            painted = role_trained | eos
            trained = _paint(
                np.where(role_trained, first, turns.content_end)[painted],
                np.where(eos, turns.end, turns.content_end)[painted],
                shape,
            )
        found = HostScan(trained, has_chat, painted_ends, turns)
        if details:
            assistant = self._assistant[turns.boundary]
            found.assistant_content = _paint(
                turns.content_start[assistant], turns.content_end[assistant], shape
            )
            found.markers = _paint(turns.start, turns.content_start, shape) | _paint(
                turns.content_end, turns.end, shape
            )
        return found


def _first_hit(hits: np.ndarray) -> np.ndarray:
    """Per column of ``hits`` (markers x candidates), the first marker that matches, else -1:
    markers are ordered longest first, so this is the longest alternative."""
    first = np.full(hits.shape[1], -1, dtype=np.int64)
    # A few masked writes, last marker first, beat a bool argmax along axis 0 (~20 us).
    for marker in range(hits.shape[0] - 1, -1, -1):
        first[hits[marker]] = marker
    return first


def _paint(starts: np.ndarray, ends: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A bool mask of ``shape``, True where the spans ``[starts, ends)`` (flat positions, each
    within one row, end included) cover a token: where more spans have opened than closed."""
    size = shape[0] * shape[1]
    if starts.size == 0:
        return np.zeros(shape, dtype=bool)
    where = np.empty(2 * starts.size, dtype=np.int64)
    where[0::2] = starts
    where[1::2] = ends
    step = np.ones(2 * starts.size, dtype=np.int64)
    step[1::2] = -1
    order = np.argsort(where, kind="stable")  # ~3 us: turn order is almost always sorted
    # bounds: 0, the sorted events, size; run i lies between bounds i and i + 1 and is covered
    # when the events before it leave more spans open than closed.
    bounds = np.empty(where.size + 2, dtype=np.int64)
    bounds[0], bounds[-1] = 0, size
    np.take(where, order, out=bounds[1:-1])
    covered = np.empty(where.size + 1, dtype=bool)
    covered[0] = False
    np.greater(np.cumsum(step[order]), 0, out=covered[1:])
    return np.repeat(covered, bounds[1:] - bounds[:-1]).reshape(shape)
