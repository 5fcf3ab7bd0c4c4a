"""Turn (input_ids, labels) into masked labels: trained turns kept, the rest, pad and media -100.

Masking only ever adds -100: a label the caller already masked stays masked, so a collator that
built completion-only labels keeps them. Rows without chat markers (plain text) keep their labels,
and rows whose labels are not the input ids (MLM, pre-shifted or encoder-decoder targets) are left
alone, so the same masker is safe on every batch.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from autooffload.log import logger, warn_once
from autooffload.masking.boundaries import HostScan, MaskingOptions, Scanner, host_array
from autooffload.masking.markers import IdFinder, isin_ids
from autooffload.masking.templates import (
    chat_template_of,
    check_markers_without_tokenizer,
    detect_family,
    media_token_ids,
    resolve,
    special_id_blocks,
    specs_from_settings,
    tokenizer_of,
)

IGNORE_INDEX = -100


@dataclass
class MaskingStats:
    """Running counts over every masked batch: chat samples seen and those left with no label."""

    samples: int = 0
    all_masked: int = 0


@dataclass
class PackedSegments:
    """Where each packed sequence lies: ``segment`` and ``offset`` of every flat token, and the
    shape ``(n_segments, longest)`` that holds one sequence per row."""

    segment: np.ndarray
    offset: np.ndarray
    shape: tuple[int, int]

    def to_rows(self, values: np.ndarray, fill: int) -> np.ndarray:
        """``values`` (the packed batch's shape) laid out one sequence per row, ``fill`` after."""
        rows = np.full(self.shape, fill, dtype=values.dtype)
        rows[self.segment, self.offset] = values.reshape(-1)
        return rows

    def from_rows(self, rows: np.ndarray) -> np.ndarray:
        """The flat packed batch back from its one-sequence-per-row layout."""
        return rows[self.segment, self.offset]


def packed_segments(
    position_ids: np.ndarray, attention_mask: np.ndarray | None = None
) -> PackedSegments | None:
    """The sequences of a packed batch, where ``position_ids`` restart at 0 inside a row (and a
    row's start always begins one); None when no row holds more than one. A run of zeros is one
    start: padding takes position 0 (TRL's ``return_position_ids``, ``pad_to_multiple_of``), and
    must not make every pad a sequence of its own."""
    if position_ids.ndim != 2 or position_ids.shape[1] < 2:
        return None
    zero = position_ids == 0
    starts = np.empty_like(zero)
    starts[:, 0] = True
    np.greater(zero[:, 1:], zero[:, :-1], out=starts[:, 1:])  # a zero after a non-zero
    if attention_mask is not None and attention_mask.shape == position_ids.shape:
        starts[:, 1:] &= attention_mask[:, 1:] != 0  # padding of a padded batch starts nothing
    if not starts[:, 1:].any():
        return None
    flat_starts = starts.reshape(-1)
    first = np.flatnonzero(flat_starts)
    segment = np.cumsum(flat_starts) - 1
    offset = np.arange(flat_starts.size) - first[segment]
    lengths = np.diff(np.append(first, flat_starts.size))
    return PackedSegments(segment, offset, (first.size, int(lengths.max())))


class LabelMasker:
    """Masks the labels of batches made by one tokenizer or processor.

    ``special_ids`` is ``(below, start)`` as ``templates.special_id_blocks`` gives it: the blocks
    of added tokens at the ends of the vocabulary, where the marker and media candidates are
    found with one compare per block (``(0, None)``: one ``==`` per id).
    """

    def __init__(
        self,
        scanner: Scanner,
        family: str,
        pad_token_id: int | None = None,
        media_ids: Sequence[int] = (),
        stats: MaskingStats | None = None,
        special_ids: tuple[int, int | None] = (0, None),
    ) -> None:
        self.scanner = scanner
        self.family = family
        self.pad_token_id = pad_token_id
        self.media_ids = tuple(media_ids)
        self.stats = stats if stats is not None else MaskingStats()
        self.special_ids = special_ids
        self._finders: dict[int | None, IdFinder] = {}  # by pad id, which callers may change
        self._media_begin_markers = bool(set(self.media_ids) & set(scanner.anchor_ids))

    def mask(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        assistant_mask: torch.Tensor | None = None,
        count: bool = True,
        labels_match_ids: bool = False,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Masked labels for ``input_ids`` (``labels`` defaults to a copy of them).

        Returns a new tensor, or ``labels`` itself when no row has chat markers. ``assistant_mask``
        (from a ``{% generation %}`` template) replaces the scanner's assistant contents and is
        cross-checked against them; ``count`` adds the batch to the all -100 sample count.
        ``labels_match_ids``: the caller built ``labels`` as the ids with -100 exactly where
        ``attention_mask`` is 0 (TRL's collator on examples without labels), so comparing them
        with the ids (one pass over the batch) is skipped; ignored without ``attention_mask``.
        ``position_ids`` that restart inside a row (packed sequences, TRL's ``padding_free``):
        each sequence is masked as a row of its own (``_mask_packed``).
        """
        if position_ids is not None and position_ids.shape == input_ids.shape:
            attention = None if attention_mask is None else host_array(attention_mask)
            segments = packed_segments(host_array(position_ids), attention)
            if segments is not None:
                return self._mask_packed(
                    segments, input_ids, labels, attention_mask, assistant_mask, count
                )
        squeeze = input_ids.dim() == 1
        if squeeze:
            input_ids = input_ids.unsqueeze(0)
            labels = None if labels is None else labels.unsqueeze(0)
            attention_mask = None if attention_mask is None else attention_mask.unsqueeze(0)
            assistant_mask = None if assistant_mask is None else assistant_mask.unsqueeze(0)
        if labels is not None and labels.shape != input_ids.shape:
            return labels.squeeze(0) if squeeze else labels
        pad = self.pad_token_id
        # Only a pad id that is also an end marker (pad = eos) needs the end markers painted.
        pad_is_marker = attention_mask is None and pad in self.scanner.marker_token_ids
        # The whole call works on host numpy views (see the boundaries module for why); each
        # line below is at most one pass over the batch.
        ids = host_array(input_ids)
        flat = ids.reshape(-1)
        at = self._candidates(flat)
        found = self.scanner.scan_host(
            ids, details=assistant_mask is not None, end_markers=pad_is_marker, candidates=at
        )
        if not found.has_chat.all():
            # A chat row cut inside its first marker has no turn: nothing in it is trained.
            cut = self.scanner.cut_in_first_marker(
                flat, at, found.has_chat, lambda rows: self._row_ends(ids, rows, attention_mask)
            )
            if cut is not None:
                found.has_chat |= cut
                if self.scanner.options.train_on_inputs:
                    found.trained[cut] = True
        if not found.has_chat.any():  # no row has chat markers
            return None if labels is None else (labels.squeeze(0) if squeeze else labels)

        base = ids if labels is None else host_array(labels)
        rows = found.has_chat
        keep = found.trained  # a fresh array: made the mask of the labels kept, in place
        if assistant_mask is not None:
            generation = host_array(assistant_mask).astype(bool)
            keep = self._use_generation_mask(found, generation, attention_mask)
        if labels is not None and not (labels_match_ids and attention_mask is not None):
            # Labels that differ from the ids are the caller's -100s (kept, and counted as
            # ignored) or, anywhere else, not a copy of the ids (MLM, pre-shifted): those rows
            # are left alone. The differing tokens are few (padding), so they are listed.
            differ = (base != ids).reshape(-1).nonzero()[0]
            caller_masked = base.reshape(-1).take(differ) == IGNORE_INDEX
            if np.count_nonzero(caller_masked) < differ.size:
                rows = rows.copy()
                rows[differ[~caller_masked] // ids.shape[1]] = False
                differ = differ[caller_masked]
            keep.reshape(-1)[differ] = False
        if attention_mask is not None:
            # keep and not a pad (``==`` is ~3 us faster than ``!=`` on int64 here)
            np.greater(keep, host_array(attention_mask) == 0, out=keep)
        elif pad is not None:
            pads = ids == pad
            if pad_is_marker:
                pads &= ~found.end_markers
            keep &= ~pads
        # Media tokens are candidates that begin no marker, unless a media id begins one.
        if self.media_ids and (found.turns.unmatched or self._media_begin_markers):
            media = isin_ids(flat.take(at), self.media_ids).nonzero()[0]
            keep.reshape(-1)[at.take(media)] = False
        n_rows = np.count_nonzero(rows)
        if n_rows < rows.size:
            keep[~rows] = True
        masked = np.where(keep, base, IGNORE_INDEX)
        if count:  # rows left alone keep every label: only chat rows can keep none
            n_kept = np.count_nonzero(np.logical_or.reduce(keep, axis=1))
            self._tally(n_rows, keep.shape[0] - n_kept)
        result = torch.from_numpy(masked)
        source = input_ids if labels is None else labels
        if not source.is_cpu:
            result = result.to(source.device)
        return result.squeeze(0) if squeeze else result

    def _row_ends(
        self, ids: np.ndarray, rows: np.ndarray, attention_mask: torch.Tensor | None
    ) -> np.ndarray:
        """Per row of ``rows``, one past its last real token: before the trailing padding, found
        from ``attention_mask``, else from the pad id."""
        if attention_mask is not None and attention_mask.shape == ids.shape:
            real = host_array(attention_mask)[rows] != 0
        elif self.pad_token_id is not None:
            real = ids[rows] != self.pad_token_id
        else:
            return np.full(rows.size, ids.shape[1], dtype=np.int64)
        last = real.shape[1] - real[:, ::-1].argmax(axis=1)
        return np.where(real.any(axis=1), last, 0)

    def _mask_packed(
        self,
        segments: PackedSegments,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        assistant_mask: torch.Tensor | None,
        count: bool,
    ) -> torch.Tensor | None:
        """``mask`` on packed rows: the sequences laid out one per row (filled with
        ``_fill_id``, never read back), masked, and put back. A turn then ends with its
        sequence, ``train_on_eos="last"`` is per sequence, and a plain-text sequence packed
        beside chat keeps its labels as a plain row does. (``labels_match_ids`` is not used:
        TRL masks each sequence's first label there, so the labels differ from the ids.)"""
        ids = host_array(input_ids)
        as_rows = segments.to_rows
        masked = self.mask(
            torch.from_numpy(as_rows(ids, self._fill_id())),
            None if labels is None else torch.from_numpy(as_rows(host_array(labels), -100)),
            attention_mask=None
            if attention_mask is None
            else torch.from_numpy(as_rows(host_array(attention_mask), 0)),
            assistant_mask=None
            if assistant_mask is None
            else torch.from_numpy(as_rows(host_array(assistant_mask), 0)),
            count=count,
        )
        if masked is None:
            return labels
        result = torch.from_numpy(segments.from_rows(host_array(masked)).reshape(ids.shape))
        source = input_ids if labels is None else labels
        return result if source.is_cpu else result.to(source.device)

    def _fill_id(self) -> int:
        """An ordinary token id (no marker, media token or added token) to fill rows with:
        what fills a row is never read back, but must not end a marker or be a candidate."""
        taken = set(self.scanner.marker_token_ids) | set(self.media_ids)
        fill = max(self.special_ids[0], 0)
        while fill in taken or fill == self.pad_token_id:
            fill += 1
        return fill

    def _candidates(self, flat: np.ndarray) -> np.ndarray:
        """Sorted positions of the flat batch that may begin a marker or hold a media token,
        found in one pass where the vocabulary allows (see ``IdFinder``)."""
        finder = self._finders.get(self.pad_token_id)
        if finder is None:
            anchors_and_media = (*self.scanner.anchor_ids, *self.media_ids)
            finder = IdFinder(anchors_and_media, *self.special_ids, frequent=(self.pad_token_id,))
            self._finders[self.pad_token_id] = finder
        return finder.positions(flat)

    def _use_generation_mask(
        self, found: HostScan, assistant_mask: np.ndarray, attention_mask: torch.Tensor | None
    ) -> np.ndarray:
        """Trained tokens with the template's assistant mask in place of the scanner's contents;
        warns once (naming the template) where the two disagree. Role markers follow
        ``train_on_eos`` and what the template generates between turns (the newline after
        ChatML's ``<|im_end|>``, Gemma's ``<end_of_turn>``) is not trained, whatever it marks."""
        content = found.assistant_content
        generated = assistant_mask & found.in_turns & ~found.markers
        disagree = (generated ^ content) & found.has_chat[:, None]
        if attention_mask is not None:
            disagree &= host_array(attention_mask) != 0
        if disagree.any():
            warn_once(
                f"masking-generation-{self.family}",
                f"masking: the {self.family} chat template's {{% generation %}} mask disagrees "
                f"with the {self.family} role boundaries on {int(disagree.sum())} tokens; the "
                "template's mask is used for assistant contents, role markers follow "
                "train_on_eos — check the template or set role_boundaries",
            )
        if "assistant" not in self.scanner.options.roles_to_train:
            return found.trained
        if self.scanner.options.train_on_inputs:
            return found.trained
        return (found.trained & ~content) | generated

    def count(self, masked: torch.Tensor, rows: torch.Tensor) -> None:
        """Add the ``rows`` of ``masked`` to the running all -100 count (warned once)."""
        n_empty = int(((masked == IGNORE_INDEX).all(1) & rows).sum())
        self._tally(int(rows.sum()), n_empty)

    def _tally(self, n_rows: int, n_empty: int) -> None:
        self.stats.samples += n_rows
        self.stats.all_masked += n_empty
        if n_empty:
            logger.debug(
                "masking: %d of %d chat samples so far have every label -100",
                self.stats.all_masked,
                self.stats.samples,
            )
            warn_once(
                "masking-all-masked",
                f"masking: {self.stats.all_masked} of {self.stats.samples} chat samples so far "
                "have every label -100 (no trained turn survived: check roles_to_train, or "
                "max_length cutting the answers off); the running count is logged at DEBUG and "
                "at disable()",
            )


class MaskerCache:
    """One LabelMasker per tokenizer or processor for one set of options; logs each detected
    template family once and warns once per unknown template."""

    def __init__(
        self,
        options: MaskingOptions,
        role_boundaries: Sequence[dict[str, Any]] | None = None,
    ) -> None:
        self.options = options
        self.role_boundaries = list(role_boundaries) if role_boundaries else None
        if self.role_boundaries:
            check_markers_without_tokenizer(self.role_boundaries)
        self.stats = MaskingStats()
        self._maskers: dict[int, tuple[Any, LabelMasker | None]] = {}
        self._logged: set[str] = set()

    def get(self, obj: Any) -> LabelMasker | None:
        """The masker for a tokenizer or processor; None for an unknown chat template."""
        entry = self._maskers.get(id(obj))
        if entry is not None and entry[0]() is obj:
            return entry[1]
        masker = self._build(obj)
        try:
            ref: Any = weakref.ref(obj)
        except TypeError:
            ref = lambda obj=obj: obj  # noqa: E731 - objects without weakref support stay alive
        self._maskers[id(obj)] = (ref, masker)
        return masker

    def _build(self, obj: Any) -> LabelMasker | None:
        tokenizer = tokenizer_of(obj)
        if self.role_boundaries:
            name = "role_boundaries"
            boundaries = resolve(tokenizer, specs_from_settings(self.role_boundaries), True)
        else:
            family = detect_family(obj)
            boundaries = resolve(tokenizer, family.boundaries, False) if family else ()
            name = family.name if family else "unknown"
        if not boundaries:
            template = chat_template_of(obj)
            warn_once(
                f"masking-unknown-{getattr(tokenizer, 'name_or_path', '')}",
                "masking: unknown chat template "
                f"({getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)!s}, "
                f"{'no template' if template is None else 'template not recognised'}); labels "
                "are left as they are (training on every token) — set role_boundaries "
                "(AUTOOFFLOAD_ROLE_BOUNDARIES) to mask, or mask=False to silence this",
            )
            return None
        options = self.options
        if name not in self._logged:
            self._logged.add(name)
            # DEBUG only: the INFO line comes with the first batch whose labels masking changes.
            logger.debug(
                "masking: %s, roles=[%s], train_on_eos=%s%s",
                name,
                ",".join(options.roles_to_train),
                options.train_on_eos,
                ", train_on_inputs" if options.train_on_inputs else "",
            )
        pad = getattr(tokenizer, "pad_token_id", None)
        return LabelMasker(
            Scanner(boundaries, options),
            family=name,
            pad_token_id=pad if isinstance(pad, int) else None,
            media_ids=media_token_ids(obj),
            stats=self.stats,
            special_ids=special_id_blocks(obj),
        )
