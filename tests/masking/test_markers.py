"""Marker candidates and marker lookup (``autooffload/masking/markers.py``) on synthetic ids."""

from __future__ import annotations

import numpy as np
from _tokenizers import load_tokenizer

from autooffload.masking.markers import IdFinder, MarkerTable
from autooffload.masking.templates import special_id_blocks, whitespace_merges


def test_id_finder_finds_every_id_in_one_compare_per_block():
    flat = np.array([5, 900, 1, 7, 998, 999, 3, 950, 2, 997])
    # 997-999 lie in the top block of added tokens, 1-2 in the bottom one; 7 is an ordinary id.
    finder = IdFinder([998, 999, 2, 7], special_below=3, special_from=990)
    at = finder.positions(flat)
    assert set(np.flatnonzero(np.isin(flat, [998, 999, 2, 7]))) <= set(at.tolist())
    assert at.tolist() == [2, 3, 4, 5, 8]  # also 1: an added token below 2, rare in text


def test_id_finder_keeps_the_pad_out_of_block_compares():
    flat = np.array([0, 0, 0, 1, 2, 5, 0])
    finder = IdFinder([1, 2], special_below=4, frequent=(0,))  # pad 0 is in the bottom block
    assert finder.positions(flat).tolist() == [3, 4]


def test_id_finder_stops_using_blocks_after_a_batch_full_of_added_tokens():
    dense = np.array([998, 997, 999, 996, 5, 998, 997, 996])  # added tokens everywhere
    finder = IdFinder([996], special_from=990)
    assert finder.positions(dense).tolist() == [0, 1, 2, 3, 5, 6, 7]
    assert finder.positions(dense).tolist() == [3, 7]  # one == per id from now on


def test_marker_table_finds_the_longest_marker_among_many():
    starts = [(1, k, 9) for k in range(20, 40)] + [(1,)]  # 21 start markers: two bit sets
    table = MarkerTable([*starts, (2,)], len(starts))
    flat = np.array([1, 25, 9, 1, 39, 9, 1, 7, 2, 1, 21, 8])
    at = np.array([0, 3, 6, 8, 9])
    start_code, end_code = table.find(flat, at, seq_len=flat.size)
    assert start_code.tolist() == [6, 20, 21, 0, 21]  # marker index + 1; (1,) where no role
    assert end_code.tolist() == [0, 0, 0, 22, 0]


def test_marker_table_with_row_ends_does_not_read_into_the_next_row():
    table = MarkerTable([(1, 2), (1,)], 2)
    flat = np.array([0, 0, 1, 2, 0, 0])  # two rows of 3: the (1, 2) at 2 is cut by the row end
    at = np.array([2])
    assert table.find(flat, at, seq_len=3)[0].tolist() == [1]  # read on: the caller checks
    assert table.find(flat, at, seq_len=3, row_ends=True)[0].tolist() == [2]


def test_special_id_blocks_of_a_real_tokenizer():
    # Qwen3: the added tokens (<|endoftext|>, <|im_start|>, ..., <think>) end the vocabulary.
    assert special_id_blocks(load_tokenizer("qwen3")) == (0, 151643)


def test_marker_table_matches_a_last_token_alternative_and_only_there():
    # Markers (1, 5, 9) and (1, 6, 9); 9 may also be 90 or 91 at the first one's end only.
    table = MarkerTable([(1, 5, 9), (1, 6, 9), (2,)], 2, [(90, 91), ()])
    flat = np.array([1, 5, 90, 1, 6, 90, 1, 5, 91, 1, 5, 9, 90, 1, 90, 9])
    at = np.array([0, 3, 6, 9, 13])
    start_code, _ = table.find(flat, at, seq_len=flat.size)
    assert start_code.tolist() == [1, 0, 1, 1, 0]
    # Never a first token: a one-token marker keeps its one id.
    single = MarkerTable([(9,), (2,)], 1, [(90,)])
    assert single.find(np.array([90, 9]), np.array([0, 1]), seq_len=2)[0].tolist() == [0, 1]


def test_whitespace_merges_of_real_tokenizers():
    for family in ("qwen3", "llama3.1"):
        tokenizer = load_tokenizer(family)
        newline = tokenizer.encode("\n", add_special_tokens=False)
        assert len(newline) == 1
        merges = whitespace_merges(tokenizer, newline[0])
        texts = [tokenizer.decode([i]) for i in merges]
        assert "\n\n" in texts and "\n\n\n" in texts
        assert all(t.startswith("\n") and not t.strip() and t != "\n" for t in texts)
        word = tokenizer.encode("hello", add_special_tokens=False)[0]
        assert whitespace_merges(tokenizer, word) == ()
