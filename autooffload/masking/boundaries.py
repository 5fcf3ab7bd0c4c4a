"""The role-boundary scanner: which tokens of a batch of chat token ids belong to trained turns.

A turn is found from token-id markers: it opens at a *start* marker of its boundary and its content
runs until the first *end* marker of that boundary, or the next start marker of any boundary, or the
end of the sequence (a truncated final turn). Shared markers are not consumed: Mistral's ``[/INST]``
both ends a user turn (as its end marker) and starts the assistant turn (as its start marker); at
equal positions end events are handled before start events, so one token can close a turn and open
the next.

The algorithm, on a ``[batch, seq]`` batch seen as one flat row-major array:

1. Candidates, the only full pass of the scan: the positions of every marker's first token, from
   one ``==`` per id (the label masker finds them together with the media placeholders, with one
   compare per block of added tokens: ``markers.IdFinder``), listed in (row, column) order.
2. Markers: ``markers.MarkerTable`` gathers the tokens after every candidate at once and looks
   them up in one bit-set table per offset: the longest start and end marker at each candidate.
3. Turns: each start marker opens a turn, bounded by the next start in its row; the first end
   marker closing it is the next end candidate (a running count) in the usual layout, where no
   marker begins inside another, else the first one found by ``searchsorted``, once per group of
   end markers that close the same boundaries.
4. Paint: each turn contributes at most one trained span (its contents, followed by its end
   marker when that is trained). Sorted, disjoint spans (the usual layout) cut the batch into runs
   alternately out and in; otherwise the spans become +1/-1 events whose running sum gives each
   run's coverage. ``ndarray.repeat`` writes the runs out as the ``[batch, seq]`` mask.

The work runs in numpy on the host, ~60 array calls for a whole mask call. On the 32 x 4096 collate
batch, single-threaded, torch's CPU ``==`` takes 44 us where numpy's takes 12 us, ``nonzero`` 96 us
against 15 us, and a small op on the candidate arrays ~4 us of dispatch in torch against 1-2 us in
numpy. Right after a collate an array op whose code is out of the caches costs 10-47 us more than
warm (each measured alone), so the hot path uses few kinds of op: ``take`` for gathers rather than
fancy or boolean indexing, ufuncs rather than the Python wrappers ``np.clip`` and ``np.append``.
Tensors on an accelerator (only the forward-time catch of hand-written collates sees them) are
copied to the host and the result back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from autooffload.masking.markers import MarkerTable, isin_ids

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
    start_merges: tuple[int, ...] = ()
    """Ids that also end a start marker in place of its last token: that token is whitespace
    (ChatML's ``\n``) and the tokenizer merged it with the content's leading whitespace
    (``\n\n`` where an answer opens with a newline). The merged token is not trained."""


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
    batch (``row * seq_len + column``). ``unmatched``: some marker candidate began no marker
    (other tokens were among the candidates)."""

    row: np.ndarray
    boundary: np.ndarray
    start: np.ndarray
    content_start: np.ndarray
    content_end: np.ndarray
    end: np.ndarray
    closed: np.ndarray
    unmatched: bool = True


@dataclass
class HostScan:
    """What the scanner found in a ``[batch, seq]`` batch, as host (numpy) arrays.

    ``trained`` marks trained tokens of rows with chat markers (all False in other rows);
    ``has_chat`` marks rows with at least one start marker; ``end_markers`` marks trained
    end-marker tokens (when asked for); ``assistant_content``, ``markers`` (every marker token)
    and ``in_turns`` (every token of a turn: its markers and contents, not what lies between
    turns) are filled only when the scan was asked for details.
    """

    trained: np.ndarray
    has_chat: np.ndarray
    end_markers: np.ndarray | None
    turns: Turns
    assistant_content: np.ndarray | None = None
    markers: np.ndarray | None = None
    in_turns: np.ndarray | None = None


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
    in_turns: torch.Tensor | None = None


def host_array(tensor: torch.Tensor) -> np.ndarray:
    """A C-contiguous numpy array with the values of ``tensor`` (a view for host tensors)."""
    try:
        array = tensor.numpy()  # a host tensor that needs no grad: the cheapest way
    except (RuntimeError, TypeError):
        array = tensor.detach().cpu().numpy()
    return np.ascontiguousarray(array)


class Scanner:
    """Finds the turns of token-id batches for a fixed set of boundaries and options."""

    def __init__(self, boundaries: tuple[RoleBoundary, ...], options: MaskingOptions) -> None:
        self.boundaries = boundaries
        self.options = options
        # Longest markers first, so a longer alternative wins over its prefix at the same place.
        starts = {(tuple(m), i) for i, b in enumerate(boundaries) for m in b.starts if m}
        starts = sorted(starts, key=lambda item: (-len(item[0]), item))
        ends = {tuple(m) for b in boundaries for m in b.ends if m}
        ends = sorted(ends, key=lambda m: (-len(m), m))
        markers = [m for m, _ in starts] + ends
        self.marker_token_ids = frozenset(t for m in markers for t in m)
        self._start_markers = [m for m, _ in starts]
        merges = [boundaries[b].start_merges for _, b in starts]
        self._markers = MarkerTable(markers, len(starts), merges)
        self._anchor_ids = self._markers.first_ids
        # Per marker code (0: none, then index + 1): its length and a start marker's boundary.
        self._code_length = np.array([0] + [len(m) for m in markers], dtype=np.int64)
        self._code_boundary = np.array([0] + [b for _, b in starts] + [0] * len(ends))
        # End markers grouped by the boundaries they close: (is the code in the group, closes[b]
        # or None when the group closes every boundary); one group for most templates.
        by_closed: dict[tuple[bool, ...], list[int]] = {}
        for k, end in enumerate(ends):
            closed = tuple(end in {tuple(m) for m in b.ends} for b in boundaries)
            by_closed.setdefault(closed, []).append(len(starts) + k + 1)
        self._end_groups = []
        for closed, codes in by_closed.items():
            in_group = np.zeros(len(markers) + 1, dtype=bool)
            in_group[codes] = True
            self._end_groups.append((in_group, None if all(closed) else np.array(closed)))
        end_lengths = {len(m) for m in ends}
        self._end_length = end_lengths.pop() if len(end_lengths) == 1 else None
        self._multi_token_ends = any(len(m) > 1 for m in ends)
        # Most templates: no token begins both a start and an end marker, and none begins a
        # marker inside another. Then no marker candidate is both, and a turn's span ends at or
        # before the next turn's start: the spans are sorted and disjoint.
        start_anchors, end_anchors = {m[0] for m, _ in starts}, {m[0] for m in ends}
        inner_tokens = {t for m in markers for t in m[1:]}
        shared = start_anchors & end_anchors or inner_tokens & (start_anchors | end_anchors)
        self._simple_layout = not shared
        trained_roles = set(options.roles_to_train)
        self._role_trained = np.array([b.role in trained_roles for b in boundaries], dtype=bool)
        self._include_start = np.array([b.include_start for b in boundaries], dtype=bool)
        self._include_end = np.array([b.include_end for b in boundaries], dtype=bool)
        self._assistant = np.array([b.role == "assistant" for b in boundaries], dtype=bool)
        self._every_end_included = bool(self._include_end.all())
        self._some_start_included = bool(self._include_start.any())
        self._alternating = np.zeros(0, dtype=bool)  # [False, True, False, ...], grown on use

    def cut_in_first_marker(
        self,
        flat: np.ndarray,
        at: np.ndarray,
        has_chat: np.ndarray,
        row_ends: Callable[[np.ndarray], np.ndarray],
    ) -> np.ndarray | None:
        """Which rows without a start marker end inside one (None: no row): their last real
        tokens are a start marker's first tokens, its first token included. Such a row is a
        chat truncated inside its first marker. ``flat`` is a row-major ``[len(has_chat), seq]``
        batch, ``at`` sorted flat positions that include every ``anchor_ids`` token, and
        ``row_ends(rows)`` gives, per row, one past its last real token (before padding)."""
        seq_len = flat.size // max(has_chat.size, 1)
        row = at // seq_len
        at = at[~has_chat[row] & isin_ids(flat.take(at), self._anchor_ids)]
        if not at.size:  # the usual case: read no padding
            return None
        rows = np.unique(at // seq_len)
        ends = np.zeros(has_chat.size, dtype=np.int64)
        ends[rows] = row_ends(rows)
        cut = np.zeros_like(has_chat)
        for position in at.tolist():
            row_index = position // seq_len
            tail = tuple(flat[position : row_index * seq_len + ends[row_index]].tolist())
            cut[row_index] |= any(
                len(marker) > len(tail) > 0 and marker[: len(tail)] == tail
                for marker in self._start_markers
            )
        return cut if cut.any() else None

    @property
    def anchor_ids(self) -> list[int]:
        """The first token of every marker: where a marker can begin."""
        return self._anchor_ids

    def find_turns(
        self, input_ids: torch.Tensor | np.ndarray, candidates: np.ndarray | None = None
    ) -> Turns:
        """Every turn of a ``[batch, seq]`` batch, found with array ops over marker candidates:
        ``candidates``, sorted flat positions that include every ``anchor_ids`` token (others
        are passed over), else the positions of those tokens."""
        ids = input_ids if isinstance(input_ids, np.ndarray) else host_array(input_ids)
        seq_len = ids.shape[1]
        flat = ids.reshape(-1)
        at = candidates
        if at is None:
            at = isin_ids(flat, self._anchor_ids).nonzero()[0]  # sorted by (row, column)
        row_ends = self._multi_token_ends  # one that long can be read on into the next row
        while True:
            start_code, end_code = self._markers.find(flat, at, seq_len, row_ends)
            is_start = (start_code != 0).nonzero()[0]  # ~2 us less than an int16 nonzero
            start, code = at.take(is_start), start_code.take(is_start)
            content_start = start + self._code_length.take(code)
            row = start // seq_len
            row_end = row * seq_len + seq_len
            if row_ends or not np.count_nonzero(content_start > row_end):
                break
            row_ends = True  # a start marker read on into the next row: find them within rows
        boundary = self._code_boundary.take(code)
        # The next start in the same row bounds each turn, else the end of the row.
        bound = row_end.copy()
        np.minimum(start[1:], row_end[:-1], out=bound[:-1])
        end_at, end_length, n_ends = self._first_ends(
            at, end_code, is_start, content_start, boundary, flat.size + 1
        )
        if self._simple_layout:
            # A closing end marker lies before the next start and within the row, and any
            # other end lies at or after the bound: closed where the end marker ends by then.
            end = end_at + end_length
            closed = end <= bound
            np.minimum(end, bound, out=end)
            content_end = np.minimum(end_at, bound)
            unmatched = is_start.size + n_ends < at.size
        else:
            # At equal positions the end marker wins: [/INST] closes the user turn, then opens
            # the next; an end past the row's last token is in another row.
            closed = end_at <= np.minimum(bound, row_end - 1)
            end = np.where(closed, end_at + end_length, bound)
            content_end = np.where(closed, end_at, bound)
            unmatched = np.count_nonzero(start_code | end_code) < at.size
        return Turns(row, boundary, start, content_start, content_end, end, closed, unmatched)

    def _first_ends(
        self,
        at: np.ndarray,
        end_code: np.ndarray,
        is_start: np.ndarray,
        content_start: np.ndarray,
        boundary: np.ndarray,
        no_end: int,
    ) -> tuple[np.ndarray, np.ndarray | int, int]:
        """Per turn, the position and length of the first end marker at or after its content
        start that closes its boundary (later rows included: the caller rejects those), else
        ``no_end``; searched once per group of end markers that close the same boundaries.
        Also the number of candidates where an end marker begins."""
        if len(self._end_groups) == 1 and self._end_groups[0][1] is None:
            # One group closing every boundary (most templates); the lengths are often equal.
            has_end = end_code != 0
            is_end = has_end.nonzero()[0]
            ends = np.empty(is_end.size + 1, dtype=at.dtype)
            at.take(is_end, out=ends[:-1])
            ends[-1] = no_end  # the sentinel: no end after this
            if self._simple_layout:
                # No end marker begins inside a start marker or where one begins: the first
                # end at or after a turn's contents is the first end candidate after its start
                # candidate, counted with a running sum (~3 us where searchsorted takes ~15).
                index = has_end.cumsum().take(is_start)
            else:
                index = ends.searchsorted(content_start)
            if self._end_length is not None:
                return ends.take(index), self._end_length, is_end.size
            lengths = np.append(self._code_length.take(end_code.take(is_end)), 0)
            return ends.take(index), lengths.take(index), is_end.size
        end_at = np.full_like(content_start, no_end)
        end_length = np.zeros_like(content_start)
        for in_group, closes in self._end_groups:
            is_end = in_group[end_code].nonzero()[0]
            ends = np.append(at[is_end], no_end)
            lengths = np.append(self._code_length[end_code[is_end]], 0)
            index = np.searchsorted(ends, content_start)
            first = ends[index]
            better = first < end_at if closes is None else closes[boundary] & (first < end_at)
            end_at = np.where(better, first, end_at)
            end_length = np.where(better, lengths[index], end_length)
        return end_at, end_length, np.count_nonzero(end_code)

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
        paints the trained end markers on their own, ``details`` the assistant contents, every
        marker token and every token of a turn."""
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
            tensor(found.in_turns),
        )

    def scan_host(
        self,
        input_ids: np.ndarray,
        details: bool = False,
        end_markers: bool = False,
        candidates: np.ndarray | None = None,
    ) -> HostScan:
        """``scan`` on a ``[batch, seq]`` numpy array, with numpy results (``candidates`` as
        ``find_turns`` takes them)."""
        shape = input_ids.shape
        turns = self.find_turns(input_ids, candidates)
        has_chat = np.zeros(shape[0], dtype=bool)
        has_chat[turns.row] = True
        role_trained = self._role_trained.take(turns.boundary)
        mode = self.options.train_on_eos
        painted_ends = None
        if mode == "turn" and self._every_end_included and not (end_markers or details):
            # The common case: each trained turn's span is its contents and, when an end marker
            # closed it, that marker ([content_start, end): end is content_end when unclosed).
            if self.options.train_on_inputs:
                trained = np.repeat(has_chat, shape[1]).reshape(shape)
            else:
                first = self._span_starts(turns)
                trained_at = role_trained.nonzero()[0]
                spans = first.take(trained_at), turns.end.take(trained_at)
                trained = self._paint(*spans, shape, disjoint=self._simple_layout)
            return HostScan(trained, has_chat, None, turns)
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
        if end_markers or details:
            painted_ends = self._paint(turns.content_end[eos], turns.end[eos], shape)
        if self.options.train_on_inputs:
            trained = np.repeat(has_chat, shape[1]).reshape(shape)
        else:
            first = self._span_starts(turns)
            # A turn's contents [first, content_end) and its trained end marker
            # [content_end, end) are adjacent: one span per turn paints both.
            painted = role_trained | eos
            trained = self._paint(
                np.where(role_trained, first, turns.content_end)[painted],
                np.where(eos, turns.end, turns.content_end)[painted],
                shape,
            )
        found = HostScan(trained, has_chat, painted_ends, turns)
        if details:
            assistant = self._assistant[turns.boundary]
            found.assistant_content = self._paint(
                turns.content_start[assistant], turns.content_end[assistant], shape
            )
            found.markers = self._paint(turns.start, turns.content_start, shape) | self._paint(
                turns.content_end, turns.end, shape
            )
            found.in_turns = self._paint(turns.start, turns.end, shape)
        return found

    def _span_starts(self, turns: Turns) -> np.ndarray:
        """Where each turn's trained span begins: its start marker where its boundary includes
        the start, else its contents."""
        if not self._some_start_included:
            return turns.content_start
        return np.where(self._include_start[turns.boundary], turns.start, turns.content_start)

    def _paint(
        self,
        starts: np.ndarray,
        ends: np.ndarray,
        shape: tuple[int, ...],
        disjoint: bool = False,
    ) -> np.ndarray:
        """A bool mask of ``shape``, True where the spans ``[starts, ends)`` (flat positions, each
        within one row, end included) cover a token: where more spans have opened than closed.
        ``disjoint``: the caller knows the spans are sorted and disjoint."""
        size = shape[0] * shape[1]
        # Sorted, disjoint spans (a batch's turns almost always): the span bounds in order cut
        # the batch into runs, alternately out and in.
        bounds = np.empty(2 * starts.size + 2, dtype=np.int64)
        bounds[0], bounds[-1] = 0, size
        bounds[1:-1:2] = starts
        bounds[2:-1:2] = ends
        runs = bounds[1:] - bounds[:-1]
        if disjoint or starts.size == 0 or np.minimum.reduce(runs) >= 0:
            if self._alternating.size < runs.size:
                self._alternating = np.arange(2 * runs.size) % 2 == 1
            return self._alternating[: runs.size].repeat(runs).reshape(shape)
        # Overlapping or reversed spans: +1/-1 events in position order, covered where the
        # running sum is positive.
        where = bounds[1:-1].copy()
        step = np.ones(where.size, dtype=np.int64)
        step[1::2] = -1
        order = np.argsort(where, kind="stable")
        bounds[1:-1] = where[order]
        covered = np.empty(where.size + 1, dtype=bool)
        covered[0] = False
        np.greater(np.cumsum(step[order]), 0, out=covered[1:])
        return np.repeat(covered, bounds[1:] - bounds[:-1]).reshape(shape)
