"""Rows cut at every length train what the whole conversation trains up to the cut, as TRL's
labels (built on the whole conversation, then truncated to ``max_length``) do."""

from __future__ import annotations

import pytest
import torch
from _tokenizers import load_tokenizer
from test_real_templates import CHAT, masker_for, render

from autooffload.masking import IGNORE_INDEX

# The first token of each family's first role marker: rows cut before it hold only the BOS.
FIRST_MARKER = {
    "qwen3": "<|im_start|>",
    "llama3.1": "<|start_header_id|>",
    "gemma3": "<start_of_turn>",
}


def cuts(family: str, messages: list[dict]) -> tuple[list[int], list[int]]:
    """The rendered ids and every cut length from the first marker token on."""
    ids = render(family, messages)
    first = ids.index(load_tokenizer(family).convert_tokens_to_ids(FIRST_MARKER[family]))
    return ids, list(range(first + 1, len(ids) + 1))


@pytest.mark.parametrize("family", ["qwen3", "llama3.1", "gemma3"])
@pytest.mark.parametrize("messages", [CHAT, CHAT[1:]], ids=["system", "no-system"])
def test_every_cut_trains_the_whole_rows_labels_up_to_the_cut(family, messages):
    """A row cut inside its first role marker (``<|im_start|>user``, ``<|start_header_id|>
    system<|end_header_id|>``) trains nothing, as TRL trains nothing there."""
    ids, lengths = cuts(family, messages)
    masker = masker_for(family)
    whole = masker.mask(torch.tensor(ids), count=False)
    for length in lengths:
        got = masker.mask(torch.tensor(ids[:length]), count=False)
        assert got is not None, length
        assert torch.equal(got, whole[:length]), length


@pytest.mark.parametrize("family", ["qwen3", "llama3.1"])
@pytest.mark.parametrize("padding", ["attention_mask", "pad_id"])
def test_cut_rows_padded_in_one_batch(family, padding):
    """The cut is found before the padding, from the attention mask or else the pad id."""
    tokenizer = load_tokenizer(family)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids, lengths = cuts(family, CHAT)
    lengths = lengths[:12]  # inside and just past the first turns' markers
    batch = torch.full((len(lengths), len(ids)), pad, dtype=torch.long)
    attention = torch.zeros_like(batch)
    for row, length in enumerate(lengths):
        batch[row, :length] = torch.tensor(ids[:length])
        attention[row, :length] = 1
    masker = masker_for(family)
    masker.pad_token_id = pad
    labels = batch.masked_fill(attention == 0, IGNORE_INDEX)
    mask_kwargs = {"attention_mask": attention} if padding == "attention_mask" else {}
    got = masker.mask(batch, labels, count=False, **mask_kwargs)
    whole = masker.mask(torch.tensor(ids), count=False)
    for row, length in enumerate(lengths):
        assert torch.equal(got[row, :length], whole[:length]), length
        assert bool((got[row, length:] == IGNORE_INDEX).all()), length


def test_a_marker_token_away_from_the_row_end_leaves_plain_text_alone():
    """Only a row that ends inside a start marker is a cut chat; plain text keeps its labels."""
    tokenizer = load_tokenizer("qwen3")
    text = tokenizer("Once upon a time.", add_special_tokens=False)["input_ids"]
    marker = tokenizer.convert_tokens_to_ids("<|im_start|>")
    masker = masker_for("qwen3")
    assert masker.mask(torch.tensor(text), count=False) is None
    inside = masker.mask(torch.tensor([marker, *text]), count=False)
    assert inside is None  # an anchor followed by no marker, not at the row end: plain text
