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

from dataclasses import dataclass, field

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
class ScanResult:
    """What the scanner found in a ``[batch, seq]`` batch.

    ``trained`` marks trained tokens of rows with chat markers (all False in other rows);
    ``has_chat`` marks rows with at least one start marker; ``end_markers`` marks trained
    end-marker tokens; ``assistant_content`` and ``markers`` (every marker token) are filled only
    when the scan was asked for details.
    """

    trained: torch.Tensor
    has_chat: torch.Tensor
    end_markers: torch.Tensor
    turns: list[Turn] = field(default_factory=list)
    assistant_content: torch.Tensor | None = None
    markers: torch.Tensor | None = None


_END, _START = 0, 1


class Scanner:
    """Finds the turns of token-id batches for a fixed set of boundaries and options."""

    def __init__(self, boundaries: tuple[RoleBoundary, ...], options: MaskingOptions) -> None:
        self.boundaries = boundaries
        self.options = options
        # Every distinct marker once: (token ids, kind, boundary index for starts / -1 for ends).
        markers: dict[tuple[tuple[int, ...], int, int], None] = {}
        for index, boundary in enumerate(boundaries):
            for start in boundary.starts:
                markers[(tuple(start), _START, index)] = None
            for end in boundary.ends:
                markers[(tuple(end), _END, -1)] = None
        self._markers = [marker for marker in markers if marker[0]]
        self._end_sets = [frozenset(tuple(end) for end in b.ends) for b in boundaries]
        self._anchor_ids = sorted({marker[0][0] for marker in self._markers})
        self._anchors: dict[torch.device, torch.Tensor] = {}
        self.marker_token_ids = frozenset(t for marker in self._markers for t in marker[0])

    def _anchor_tensor(self, device: torch.device) -> torch.Tensor:
        anchors = self._anchors.get(device)
        if anchors is None:
            anchors = torch.tensor(self._anchor_ids, dtype=torch.long, device=device)
            self._anchors[device] = anchors
        return anchors

    def _events(self, input_ids: torch.Tensor) -> list[tuple[int, int, int, int, int]]:
        """Marker matches as (row, col, kind, -length, boundary or end-marker id), sorted."""
        seq_len = input_ids.shape[1]
        rows, cols = torch.isin(input_ids, self._anchor_tensor(input_ids.device)).nonzero(
            as_tuple=True
        )
        if rows.numel() == 0:
            return []
        first = input_ids[rows, cols]
        events: list[tuple[int, int, int, int, int]] = []
        for marker_index, (ids, kind, boundary) in enumerate(self._markers):
            hit = first == ids[0]
            for offset in range(1, len(ids)):
                pos = cols + offset
                token = input_ids[rows, pos.clamp(max=seq_len - 1)]
                hit &= (pos < seq_len) & (token == ids[offset])
            if not bool(hit.any()):
                continue
            tag = boundary if kind == _START else marker_index
            for row, col in zip(rows[hit].tolist(), cols[hit].tolist()):
                events.append((row, col, kind, -len(ids), tag))
        events.sort()
        return events

    def turns(self, input_ids: torch.Tensor) -> list[Turn]:
        """Every turn of every row, in order (rows without markers have none)."""
        seq_len = input_ids.shape[1]
        turns: list[Turn] = []
        current_row = -1
        open_turn: tuple[int, int, int] | None = None  # (boundary, start, content_start)
        skip_until = -1

        def close(row: int, content_end: int, end: int, closed: bool) -> None:
            boundary, start, content_start = open_turn  # type: ignore[misc]
            role = self.boundaries[boundary].role
            turns.append(Turn(row, role, boundary, start, content_start, content_end, end, closed))

        for row, col, kind, neg_len, tag in self._events(input_ids):
            if row != current_row:
                if open_turn is not None:
                    close(current_row, seq_len, seq_len, False)
                current_row, open_turn, skip_until = row, None, -1
            if col < skip_until:
                continue  # inside the start marker just consumed
            if kind == _END:
                if (
                    open_turn is not None
                    and col >= open_turn[2]
                    and self._markers[tag][0] in self._end_sets[open_turn[0]]
                ):
                    close(row, col, col - neg_len, True)
                    open_turn = None
                continue
            if open_turn is not None:
                close(row, col, col, False)
            open_turn = (tag, col, col - neg_len)
            skip_until = col - neg_len
        if open_turn is not None:
            close(current_row, seq_len, seq_len, False)
        return turns

    def scan(self, input_ids: torch.Tensor, details: bool = False) -> ScanResult:
        """Scan a ``[batch, seq]`` (or ``[seq]``) tensor of token ids."""
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        batch, seq_len = input_ids.shape
        device = input_ids.device
        turns = self.turns(input_ids)
        has_chat = torch.zeros(batch, dtype=torch.bool, device=device)
        if turns:
            has_chat[torch.tensor(sorted({t.row for t in turns}), device=device)] = True
        options = self.options
        trained_roles = set(options.roles_to_train)
        last_trained: dict[int, Turn] = {}
        for turn in turns:
            if turn.role in trained_roles:
                last_trained[turn.row] = turn

        content: list[tuple[int, int, int]] = []
        ends: list[tuple[int, int, int]] = []
        for turn in turns:
            boundary = self.boundaries[turn.boundary]
            role_trained = turn.role in trained_roles
            if role_trained:
                first = turn.start if boundary.include_start else turn.content_start
                content.append((turn.row, first, turn.content_end))
            if (
                turn.closed
                and boundary.include_end
                and _eos_trained(
                    options.train_on_eos, role_trained, last_trained.get(turn.row) is turn
                )
            ):
                ends.append((turn.row, turn.content_end, turn.end))

        end_markers = _paint(ends, batch, seq_len, device)
        if options.train_on_inputs:
            trained = has_chat.unsqueeze(1).expand(batch, seq_len).clone()
        else:
            trained = _paint(content, batch, seq_len, device) | end_markers
        result = ScanResult(trained, has_chat, end_markers, turns)
        if details:
            result.assistant_content = _paint(
                [(t.row, t.content_start, t.content_end) for t in turns if t.role == "assistant"],
                batch,
                seq_len,
                device,
            )
            marker_spans = [(t.row, t.start, t.content_start) for t in turns]
            marker_spans += [(t.row, t.content_end, t.end) for t in turns if t.closed]
            result.markers = _paint(marker_spans, batch, seq_len, device)
        return result


def _eos_trained(mode: str, role_trained: bool, is_last_trained: bool) -> bool:
    if mode == "all":
        return True
    if mode == "turn":
        return role_trained
    if mode == "last":
        return role_trained and is_last_trained
    return False


def _paint(
    spans: list[tuple[int, int, int]], batch: int, seq_len: int, device: torch.device
) -> torch.Tensor:
    """A ``[batch, seq_len]`` bool mask, True inside the half-open ``(row, start, end)`` spans."""
    if not spans:
        return torch.zeros(batch, seq_len, dtype=torch.bool, device=device)
    spans_t = torch.tensor(spans, dtype=torch.long, device=device)
    rows, starts, ends = spans_t.unbind(1)
    width = seq_len + 1
    delta = torch.zeros(batch * width, dtype=torch.int32, device=device)
    ones = torch.ones_like(rows, dtype=torch.int32)
    delta.index_add_(0, rows * width + starts, ones)
    delta.index_add_(0, rows * width + ends, -ones)
    return delta.view(batch, width).cumsum(1)[:, :seq_len] > 0
