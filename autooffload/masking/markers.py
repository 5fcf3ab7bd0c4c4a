"""Marker candidates in a flat token-id array, and which start and end marker begins at each.

``IdFinder`` lists the candidates: the positions of the markers' first tokens (and of other ids
the caller wants, media placeholders), in few passes over the batch.

A marker is a short token-id sequence. ``MarkerTable`` answers, for each candidate position (a
token that is the first token of some marker), which is the longest start marker and the longest
end marker found there, with a fixed number of array ops whatever the number of markers:

- the tokens at offsets ``0 .. longest - 1`` after every candidate are gathered at once, as an
  ``[offset, candidate]`` array (one row per offset: numpy's loops over a short last axis cost
  ~10x more than over a long one);
- each offset has a lookup table from token id to a bit set of the markers that have that token
  at that offset, or are shorter than the offset (past their end every token matches). The tables
  are dense over the range of the ids markers use at that offset, with one entry below and one
  above for every other id; ids are clipped into that range;
- the bit sets are ANDed over the offsets: what is left are the markers that match there;
- a table indexed by that bit set gives the first (longest) start and end marker in it.

Markers are bits of at most 16-bit sets; more than 16 markers are looked up 16 at a time and the
first chunk that has a match wins (markers are ordered longest first).

A marker must end in the candidate's row. Checking that for every candidate costs five array ops;
``find`` reads on into the next row unless asked not to, and its caller, which knows where each
start marker ends, asks again in the rare batch where one ends past its row (a scanner with end
markers longer than one token, which nothing checks later, always asks with ``row_ends``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_CHUNK = 16  # markers per bit set: the first-marker tables have 2**_CHUNK entries at most
# Up to this many ids, one ``==`` per id (12 us each on 32 x 4096) beats ``np.isin`` (~130 us).
_FEW_IDS = 8


def isin_ids(values: np.ndarray, ids: Sequence[int]) -> np.ndarray:
    """A bool array: which of ``values`` are one of the token ``ids``."""
    if not ids or len(ids) > _FEW_IDS:
        return np.isin(values, ids)
    found = values == ids[0]
    for token_id in ids[1:]:
        found |= values == token_id
    return found


class IdFinder:
    """The flat positions of a token-id array that may hold one of ``ids``: all that do, and few
    that do not, in as few passes over the array as the vocabulary allows.

    Each pass reads the whole batch (1 MB of int64 on 32 x 4096, ~13 us from L2 and twice that
    from L3, where a collated batch is). Ids inside a block of added tokens at either end of the
    vocabulary (``ids < special_below``, ``ids >= special_from``: chat markers, media
    placeholders) are found with one compare per block, as every id beyond the compare is an
    added token too, rare in text; ``frequent`` ids (the pad) must not lie beyond it. The other
    ids take one ``==`` each. A batch where the block compares hit more than 1/8 of the tokens
    turns them off for later batches.
    """

    def __init__(
        self,
        ids: Sequence[int],
        special_below: int = 0,
        special_from: int | None = None,
        frequent: Sequence[int | None] = (),
    ) -> None:
        self.ids = sorted(set(ids))
        # A frequent id that is one of ``ids`` is a candidate whatever the compare.
        frequent_ids = [f for f in frequent if f is not None and f not in self.ids]
        low = [i for i in self.ids if i < special_below]
        high = [i for i in self.ids if special_from is not None and i >= special_from]
        self._below = low[-1] + 1 if low and not any(f <= low[-1] for f in frequent_ids) else None
        self._from = high[0] if high and not any(f >= high[0] for f in frequent_ids) else None
        self._exact = [
            i
            for i in self.ids
            if not (self._below is not None and i < self._below)
            and not (self._from is not None and i >= self._from)
        ]

    def positions(self, flat: np.ndarray) -> np.ndarray:
        """Sorted positions in the 1-D ``flat`` that may hold one of the ids."""
        found = isin_ids(flat, self._exact) if self._exact else None
        # ``>`` and ``<`` take ~13 us here where ``>=`` and ``<=`` take ~18 us (numpy 2.4, int64).
        if self._from is not None:
            hits = flat > self._from - 1
            found = hits if found is None else np.logical_or(found, hits, out=found)
        if self._below is not None:
            hits = flat < self._below
            found = hits if found is None else np.logical_or(found, hits, out=found)
        if found is None:
            return np.zeros(0, dtype=np.intp)
        at = found.nonzero()[0]
        if (self._below is not None or self._from is not None) and at.size > flat.size // 8:
            self._below = self._from = None
            self._exact = self.ids
        return at


class MarkerTable:
    """Finds the longest start and end marker at marker candidates.

    ``markers`` are ordered by priority (longest first); the first ``n_starts`` are start
    markers, the rest end markers. Results are *codes*: 0 for no marker, else the marker's index
    plus one, so a code indexes per-marker arrays that have an entry for "none" in front.
    """

    def __init__(
        self,
        markers: Sequence[tuple[int, ...]],
        n_starts: int,
        last_alternatives: Sequence[tuple[int, ...]] = (),
    ) -> None:
        """``last_alternatives[i]``: other ids that also match marker ``i``'s last token (not
        its first: they are not candidates), e.g. the whitespace merges of a trailing newline."""
        self.markers = [tuple(m) for m in markers]
        self.n_starts = n_starts
        alternatives = list(last_alternatives) + [()] * (len(self.markers) - len(last_alternatives))
        self._alternatives = [
            tuple(alt) if len(m) > 1 else () for m, alt in zip(self.markers, alternatives)
        ]
        self.first_ids = sorted({m[0] for m in self.markers})
        self.longest = max((len(m) for m in self.markers), default=1)
        longest = self.longest
        # Per offset: ids below ``low`` and above ``high`` share the key of ``low - 1``; each
        # offset's keys are a segment of one table, starting at ``segment``.
        low, high = [], []
        for k in range(longest):
            ids_at_k = [m[k] for m in self.markers if len(m) > k] or [0]
            ids_at_k += [
                a
                for m, alt in zip(self.markers, self._alternatives, strict=True)
                if len(m) == k + 1
                for a in alt
            ]
            low.append(min(ids_at_k))
            high.append(max(ids_at_k))
        self._low = np.array(low, dtype=np.int64)[:, None] - 1
        self._high = np.array(high, dtype=np.int64)[:, None] + 1
        sizes = self._high - self._low + 1
        self._segment = np.concatenate(([[0]], np.cumsum(sizes[:-1], axis=0)))
        self._shift = self._segment - self._low  # key = clipped id + shift
        self._offsets = np.arange(longest, dtype=np.int64)[:, None]
        self._chunks = []
        for first in range(0, len(self.markers), _CHUNK):
            members = range(first, min(first + _CHUNK, len(self.markers)))
            self._chunks.append(self._chunk(members, int(sizes.sum())))

    def _chunk(self, members: range, table_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The bit-set table of the ``members`` markers (bit i is marker ``members[i]``) and the
        first start and end code of every bit set."""
        dtype = np.uint8 if len(members) <= 8 else np.uint16
        bits = np.zeros(table_size, dtype=dtype)
        for k in range(self.longest):
            start, low = int(self._segment[k, 0]), int(self._low[k, 0])
            stop = start + int(self._high[k, 0]) - low + 1
            for bit, index in enumerate(members):
                marker = self.markers[index]
                if len(marker) <= k:  # past its end: every id matches
                    bits[start:stop] |= dtype(1 << bit)
                else:
                    bits[start + marker[k] - low] |= dtype(1 << bit)
                    if k == len(marker) - 1:
                        for alternative in self._alternatives[index]:
                            bits[start + alternative - low] |= dtype(1 << bit)
        sets = np.arange(1 << len(members))
        code_type = np.int16 if len(self.markers) < 2**15 else np.int32
        first_start = np.zeros(sets.size, dtype=code_type)
        first_end = np.zeros(sets.size, dtype=code_type)
        for bit in range(len(members) - 1, -1, -1):  # the lowest bit set wins: written last
            index = members[bit]
            first = first_start if index < self.n_starts else first_end
            first[(sets >> bit) & 1 == 1] = index + 1
        return bits, first_start, first_end

    def find(
        self, flat: np.ndarray, at: np.ndarray, seq_len: int, row_ends: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """The start and end marker codes at the sorted flat positions ``at`` of ``flat`` (a
        row-major ``[batch, seq_len]`` array): 0 where none begins, else marker index + 1.

        Without ``row_ends``, the tokens after a candidate are read on into the next row: a
        marker found there is cut by the row end (its end lies past the row's), and the caller
        asks again with ``row_ends``, where such tokens count as no token.
        """
        where = at + self._offsets  # [offset, candidate]
        # Clipped into each offset's range with two ufuncs: ``np.clip`` goes through Python
        # wrappers, ~40 us more than these the first time after a collate (cold code).
        # Past the end of the batch, "wrap" reads row 0: a marker read on past its row is
        # handled the same way wherever it reads on (and "wrap" is ~3 us faster than "clip").
        keys = np.maximum(flat.take(where, mode="wrap"), self._low)
        np.minimum(keys, self._high, out=keys)
        keys += self._shift
        if row_ends and self.longest > 1:
            np.copyto(keys, self._segment, where=where >= at // seq_len * seq_len + seq_len)
        start_code = end_code = None
        for bits_of, first_start, first_end in self._chunks:
            bits = bits_of.take(keys)
            bits = np.bitwise_and.reduce(bits, axis=0) if self.longest > 1 else bits[0]
            starts, ends = first_start.take(bits), first_end.take(bits)
            if start_code is None:
                start_code, end_code = starts, ends
            else:  # an earlier chunk's markers are longer: they win
                start_code = np.where(start_code == 0, starts, start_code)
                end_code = np.where(end_code == 0, ends, end_code)
        if start_code is None:  # no markers at all
            start_code = end_code = np.zeros(at.size, dtype=np.int16)
        return start_code, end_code
