"""Scanner and masker edge cases of the flat (row-major) scan, on synthetic token ids.

Synthetic ids on purpose: these cases (a marker cut by the end of a row, an end marker in the next
row, overlapping spans) are about batch layout, not about any template's text.
"""

from __future__ import annotations

import torch

from autooffload.masking import IGNORE_INDEX, LabelMasker, MaskingOptions, RoleBoundary, Scanner

START, USER, ASSISTANT, END = 1, 2, 3, 4  # <start> role ... <end>, like ChatML
PAD = 0


def chatml_masker(**options) -> LabelMasker:
    boundaries = (
        RoleBoundary("user", ((START, USER),), ((END,),)),
        RoleBoundary("assistant", ((START, ASSISTANT),), ((END,),)),
    )
    return LabelMasker(Scanner(boundaries, MaskingOptions(**options)), "synthetic", PAD)


def trained(labels: torch.Tensor) -> list[list[int]]:
    return [[int(t) for t in row if t != IGNORE_INDEX] for row in labels]


def test_marker_cut_by_the_row_end_does_not_continue_in_the_next_row():
    ids = torch.tensor(
        [
            [START, USER, 10, END, 9, 9, 9, START],  # <start> at the very end of row 0
            [ASSISTANT, 11, 12, END, 9, 9, 9, 9],  # row 1 begins with the role token
        ]
    )
    assert chatml_masker().scanner.turns(ids)[-1].role == "user"
    # Row 0 trains nothing; row 1 has no start marker of its own, so it is plain text, untouched.
    assert trained(chatml_masker().mask(ids, count=False)) == [[], ids[1].tolist()]


def test_end_marker_in_the_next_row_does_not_close_the_turn():
    ids = torch.tensor(
        [
            [START, USER, 10, END, START, ASSISTANT, 11, 12],  # truncated answer
            [END, START, ASSISTANT, 13, END, PAD, PAD, PAD],
        ]
    )
    turns = chatml_masker().scanner.turns(ids)
    assert [(t.row, t.role, t.content_end, t.closed) for t in turns] == [
        (0, "user", 3, True),
        (0, "assistant", 8, False),
        (1, "assistant", 4, True),
    ]
    assert trained(chatml_masker().mask(ids)) == [[11, 12], [13, END]]


def test_mixed_batch_rows_keep_their_own_treatment():
    chat = [START, USER, 10, END, START, ASSISTANT, 11, END]
    ids = torch.tensor([chat, [20, 21, 22, 23, 24, 25, 26, 27], chat, chat])
    labels = ids.clone()
    labels[2, -1] = IGNORE_INDEX  # the caller's -100 stays
    labels[3] = torch.roll(ids[3], -1)  # pre-shifted: not ours to touch
    masked = chatml_masker().mask(ids, labels)
    assert trained(masked[:3]) == [[11, END], [20, 21, 22, 23, 24, 25, 26, 27], [11]]
    assert torch.equal(masked[3], labels[3])


def test_int32_and_strided_ids_mask_like_contiguous_int64():
    rows = [
        [START, USER, 10, END, START, ASSISTANT, 11, 12, END, PAD],
        [PAD, START, USER, 13, END, START, ASSISTANT, 14, END, PAD],
    ]
    ids = torch.tensor(rows)
    expected = chatml_masker().mask(ids)
    assert torch.equal(chatml_masker().mask(ids.to(torch.int32)), expected.to(torch.int32))
    strided = torch.tensor(rows).t().contiguous().t()  # same values, column-major storage
    assert not strided.is_contiguous()
    assert torch.equal(chatml_masker().mask(strided), expected)


def test_shared_marker_with_include_start_paints_the_union_of_overlapping_spans():
    inst, close, eos = 5, 6, 7  # Mistral: [INST] user [/INST] assistant </s>
    boundaries = (
        RoleBoundary("user", ((inst,),), ((close,),)),
        RoleBoundary("assistant", ((close,),), ((eos,),), include_start=True),
    )
    options = MaskingOptions(roles_to_train=("user", "assistant"), train_on_eos="all")
    masker = LabelMasker(Scanner(boundaries, options), "synthetic", PAD)
    # The user turn's end marker [/INST] is also the assistant's (trained) start marker.
    ids = torch.tensor([[inst, 10, close, 11, eos, inst, 12, close, 13]])
    assert trained(masker.mask(ids)) == [[10, close, 11, eos, 12, close, 13]]
