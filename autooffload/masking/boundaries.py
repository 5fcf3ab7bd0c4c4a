"""The role-boundary scanner: which tokens of a batch of chat token ids belong to trained turns.

A turn is found from token-id markers: it opens at a *start* marker of its boundary and its content
runs until the first *end* marker of that boundary, or the next start marker of any boundary, or the
end of the sequence (a truncated final turn). The per-token work is vectorised: candidate positions
come from one ``torch.isin`` over the batch, full markers are verified with gathers over those
candidates only, and the trained intervals are painted back with one scatter and one ``cumsum``.
Only the (few) marker events are walked in Python, one step per turn boundary.

Shared markers are not consumed: Mistral's ``[/INST]`` both ends a user turn (as its end marker)
and starts the assistant turn (as its start marker); at equal positions end events are handled
before start events, so one token can close a turn and open the next.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """The turns of a batch as parallel 1-D tensors (one entry per turn, ordered by row, start):
    ``row``, ``boundary`` (index), ``start``, ``content_start``, ``content_end``, ``end`` and
    ``closed`` (whether an end marker closed it)."""

    row: torch.Tensor
    boundary: torch.Tensor
    start: torch.Tensor
    content_start: torch.Tensor
    content_end: torch.Tensor
    end: torch.Tensor
    closed: torch.Tensor


@dataclass
class ScanResult:
    """What the scanner found in a ``[batch, seq]`` batch.

    ``trained`` marks trained tokens of rows with chat markers (all False in other rows);
    ``has_chat`` marks rows with at least one start marker; ``end_markers`` marks trained
    end-marker tokens (when asked for); ``assistant_content`` and ``markers`` (every marker
    token) are filled only when the scan was asked for details.
    """

    trained: torch.Tensor
    has_chat: torch.Tensor
    end_markers: torch.Tensor | None
    turns: Turns
    assistant_content: torch.Tensor | None = None
    markers: torch.Tensor | None = None


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
        # closes[b, k]: end marker k closes turns of boundary b.
        self._closes = [
            [end in {tuple(m) for m in b.ends} for end in self._ends] for b in boundaries
        ]
        self._anchor_ids = sorted({m[0] for m, _ in self._starts} | {m[0] for m in self._ends})
        self.marker_token_ids = frozenset(
            t for m in [m for m, _ in self._starts] + self._ends for t in m
        )
        trained_roles = set(options.roles_to_train)
        self._role_trained = [b.role in trained_roles for b in boundaries]
        self._constants: dict[torch.device, dict[str, torch.Tensor]] = {}

    def _on(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Per-boundary tables as tensors on ``device`` (built once per device)."""
        constants = self._constants.get(device)
        if constants is None:
            bools = dict(device=device, dtype=torch.bool)
            constants = {
                "anchors": torch.tensor(self._anchor_ids, dtype=torch.long, device=device),
                "role_trained": torch.tensor(self._role_trained, **bools),
                "include_start": torch.tensor([b.include_start for b in self.boundaries], **bools),
                "include_end": torch.tensor([b.include_end for b in self.boundaries], **bools),
                "assistant": torch.tensor(
                    [b.role == "assistant" for b in self.boundaries], **bools
                ),
                "closes": torch.tensor(self._closes, **bools).view(len(self.boundaries), -1),
                "end_len": torch.tensor([len(m) for m in self._ends] or [0], device=device),
            }
            self._constants[device] = constants
        return constants

    def find_turns(self, input_ids: torch.Tensor) -> Turns:
        """Every turn of a ``[batch, seq]`` batch, found with tensor ops over marker candidates."""
        batch, seq_len = input_ids.shape
        device = input_ids.device
        tables = self._on(device)
        anchors = tables["anchors"]
        if len(self._anchor_ids) <= 4:  # a few compares beat isin's sort on long batches
            candidate = input_ids == self._anchor_ids[0]
            for anchor in self._anchor_ids[1:]:
                candidate |= input_ids == anchor
        else:
            candidate = torch.isin(input_ids, anchors)
        rows, cols = candidate.nonzero(as_tuple=True)  # row-major: sorted by (row, col)
        # The tokens following each candidate, gathered once per offset and shared by markers.
        following = [input_ids[rows, cols]]
        valid = [torch.ones_like(rows, dtype=torch.bool)]
        longest = max([len(m) for m, _ in self._starts] + [len(m) for m in self._ends])
        for offset in range(1, longest):
            pos = cols + offset
            following.append(input_ids[rows, pos.clamp(max=seq_len - 1)])
            valid.append(pos < seq_len)

        def matches(marker: tuple[int, ...]) -> torch.Tensor:
            hit = following[0] == marker[0]
            for offset in range(1, len(marker)):
                hit &= valid[offset] & (following[offset] == marker[offset])
            return hit

        start_of = torch.full_like(rows, -1)
        start_len = torch.zeros_like(rows)
        for marker, boundary in self._starts:
            hit = matches(marker) & (start_of < 0)
            start_of[hit] = boundary
            start_len[hit] = len(marker)
        is_start = start_of >= 0
        s_row, s_col, s_boundary = rows[is_start], cols[is_start], start_of[is_start]
        s_content = s_col + start_len[is_start]
        width = seq_len + 1
        # The next start in the same row bounds each turn (or the end of the sequence).
        next_col = torch.full_like(s_col, seq_len)
        same_row = s_row[1:] == s_row[:-1]
        next_col[:-1] = torch.where(same_row, s_col[1:], seq_len)
        # The first end marker that closes this boundary at or after the content start.
        end_col = torch.full_like(s_col, 2 * width)
        end_len = torch.zeros_like(s_col)
        taken = torch.zeros_like(rows, dtype=torch.bool)
        keys = s_row * width + s_content
        for k, marker in enumerate(self._ends):
            hit = matches(marker) & ~taken
            taken |= hit
            if not bool(hit.any()):
                continue
            e_keys = rows[hit] * width + cols[hit]
            index = torch.searchsorted(e_keys, keys)
            found = index < e_keys.numel()
            at = e_keys[index.clamp(max=e_keys.numel() - 1)]
            at_col = torch.where(found & (at // width == s_row), at % width, 2 * width)
            better = tables["closes"][s_boundary, k] & (at_col < end_col)
            end_col = torch.where(better, at_col, end_col)
            end_len = torch.where(better, len(marker), end_len)
        # At equal positions the end marker wins: [/INST] closes the user turn, then opens the next.
        closed = end_col <= next_col
        content_end = torch.where(closed, end_col, next_col)
        end = torch.where(closed, end_col + end_len, content_end)
        return Turns(s_row, s_boundary, s_col, s_content, content_end, end, closed)

    def turns(self, input_ids: torch.Tensor) -> list[Turn]:
        """Every turn of every row as ``Turn`` records (for debugging and tests)."""
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        found = self.find_turns(input_ids)
        columns = zip(
            found.row.tolist(),
            found.boundary.tolist(),
            found.start.tolist(),
            found.content_start.tolist(),
            found.content_end.tolist(),
            found.end.tolist(),
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
        batch, seq_len = input_ids.shape
        device = input_ids.device
        tables = self._on(device)
        turns = self.find_turns(input_ids)
        has_chat = torch.zeros(batch, dtype=torch.bool, device=device)
        has_chat[turns.row] = True
        role_trained = tables["role_trained"][turns.boundary]
        mode = self.options.train_on_eos
        eos = turns.closed & tables["include_end"][turns.boundary]
        if mode == "turn":
            eos &= role_trained
        elif mode == "last":
            order = torch.arange(turns.row.numel(), device=device)
            last = torch.full((batch,), -1, dtype=torch.long, device=device)
            last.scatter_reduce_(0, turns.row[role_trained], order[role_trained], "amax")
            eos &= role_trained & (last[turns.row] == order)
        elif mode == "none":
            eos &= False
        eos_spans = (turns.row[eos], turns.content_end[eos], turns.end[eos])
        painted_ends = _paint(*eos_spans, batch, seq_len) if end_markers or details else None
        if self.options.train_on_inputs:
            trained = has_chat.unsqueeze(1).expand(batch, seq_len).clone()
        else:
            first = torch.where(
                tables["include_start"][turns.boundary], turns.start, turns.content_start
            )
            # Contents and trained end markers painted in one pass.
            trained = _paint(
                torch.cat([turns.row[role_trained], eos_spans[0]]),
                torch.cat([first[role_trained], eos_spans[1]]),
                torch.cat([turns.content_end[role_trained], eos_spans[2]]),
                batch,
                seq_len,
            )
        result = ScanResult(trained, has_chat, painted_ends, turns)
        if details:
            assistant = tables["assistant"][turns.boundary]
            result.assistant_content = _paint(
                turns.row[assistant],
                turns.content_start[assistant],
                turns.content_end[assistant],
                batch,
                seq_len,
            )
            result.markers = _paint(
                turns.row, turns.start, turns.content_start, batch, seq_len
            ) | _paint(turns.row, turns.content_end, turns.end, batch, seq_len)
        return result


def _paint(
    rows: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, batch: int, seq_len: int
) -> torch.Tensor:
    """A ``[batch, seq_len]`` bool mask, True inside the half-open spans ``[starts, ends)``."""
    width = seq_len + 1
    delta = torch.zeros(batch * width, dtype=torch.int32, device=rows.device)
    ones = torch.ones_like(rows, dtype=torch.int32)
    delta.index_add_(0, rows * width + starts, ones)
    delta.index_add_(0, rows * width + ends, -ones)
    return delta.view(batch, width).cumsum(1)[:, :seq_len] > 0
