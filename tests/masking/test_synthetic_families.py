"""Families with no real tokenizer files here (Llama 4, Phi-3, Phi-4, Pixtral / Mistral v7,
Qwen2-VL, Llama 3.2 Vision): a SYNTHETIC tokenizer (special tokens + one token per character)
renders their documented formats; these tests check the built-in tables and detection, not a
real vocabulary's merges."""

from __future__ import annotations

import re

import pytest
import torch

from autooffload.masking import IGNORE_INDEX, MaskerCache, MaskingOptions
from autooffload.masking.templates import detect_family

SPECIALS = [
    "<unk>", "<s>", "</s>", "<|header_start|>", "<|header_end|>", "<|eot|>", "<|eom|>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|im_start|>", "<|im_end|>",
    "<|im_sep|>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]",
    "[IMG_BREAK]", "[IMG_END]", "<|image_pad|>", "<|vision_start|>", "<|vision_end|>",
    "<|image|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
]  # fmt: skip


class SyntheticTokenizer:
    """Special tokens are single ids; every other character is its own token (id 1000 + ord)."""

    unk_token, unk_token_id, eos_token, eos_token_id, pad_token_id = "<unk>", 0, "</s>", 2, None
    name_or_path = "synthetic"
    _split = re.compile("(" + "|".join(re.escape(t) for t in SPECIALS) + ")")

    def __init__(self, chat_template: str | None) -> None:
        self.chat_template = chat_template

    def __len__(self) -> int:
        return 1000 + 0x11000

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return SPECIALS.index(token) if token in SPECIALS else None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = []
        for piece in self._split.split(text):
            ids += [SPECIALS.index(piece)] if piece in SPECIALS else [1000 + ord(c) for c in piece]
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(SPECIALS[i] if i < 1000 else chr(i - 1000) for i in ids)


def rendered(family: str) -> tuple[str, list[str]]:
    """A 3-turn chat with a system prompt as ``family`` renders it, and the expected spans."""
    if family == "llama4":
        head = "<|header_start|>{}<|header_end|>\n\n"
        text = "".join(
            head.format(role) + content + "<|eot|>"
            for role, content in [("system", "Sys."), ("user", "Q1"), ("assistant", "A1"),
                                  ("user", "Q2"), ("assistant", "A2")]
        )  # fmt: skip
        return "<s>" + text, ["A1<|eot|>", "A2<|eot|>"]
    if family == "phi3":
        text = "<|system|>\nSys.<|end|>\n<|user|>\nQ1<|end|>\n<|assistant|>\nA1<|end|>\n"
        return text + "<|user|>\nQ2<|end|>\n<|assistant|>\nA2<|end|>\n", ["A1<|end|>", "A2<|end|>"]
    if family == "phi4":
        turn = "<|im_start|>{}<|im_sep|>{}<|im_end|>"
        text = "".join(turn.format(r, c) for r, c in [("system", "Sys."), ("user", "Q1"),
                                                        ("assistant", "A1"), ("user", "Q2"),
                                                        ("assistant", "A2")])  # fmt: skip
        return text, ["A1<|im_end|>", "A2<|im_end|>"]
    if (
        family == "pixtral"
    ):  # Mistral v7 / Pixtral: system prompt block, image tokens in the user turn
        text = (
            "<s>[SYSTEM_PROMPT]Sys.[/SYSTEM_PROMPT][INST][IMG][IMG][IMG_BREAK][IMG][IMG][IMG_END]"
        )
        return text + "Q1[/INST]A1</s>[INST]Q2[/INST]A2</s>", ["A1</s>", "A2</s>"]
    if family == "qwen2-vl":
        text = "<|im_start|>system\nSys.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
        text += "<|image_pad|><|image_pad|><|vision_end|>Q1<|im_end|>\n<|im_start|>assistant\nA1"
        return text + "<|im_end|>\n", ["A1<|im_end|>"]
    if family == "llama3.2-vision":
        head = "<|start_header_id|>{}<|end_header_id|>\n\n"
        text = head.format("user") + "<|image|>Q1<|eot_id|>" + head.format("assistant") + "A1"
        return text + "<|eot_id|>", ["A1<|eot_id|>"]
    raise KeyError(family)


TEMPLATES = {  # the strings each family's real template contains
    "llama4": ("llama4", "<|header_start|>...<|eot|>"),
    "phi3": ("phi3", "<|assistant|>...<|end|>"),
    "phi4": ("phi4", "<|im_start|>...<|im_sep|>...<|im_end|>"),
    "pixtral": ("mistral", "[INST]...[/INST]"),
    "qwen2-vl": ("chatml", "<|im_start|>...<|im_end|>"),
    "llama3.2-vision": ("llama3", "<|start_header_id|>...<|eot_id|>"),
}


def spans_of(tokenizer, ids, labels) -> list[str]:
    out, run = [], []
    for token, label in zip(ids.tolist(), labels.tolist()):
        if label != IGNORE_INDEX:
            run.append(token)
        elif run:
            out.append(tokenizer.decode(run))
            run = []
    return out + ([tokenizer.decode(run)] if run else [])


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_synthetic_family_trains_exactly_the_answers(family):
    expected_family, template = TEMPLATES[family]
    tokenizer = SyntheticTokenizer(template)
    assert detect_family(tokenizer).name == expected_family
    text, expected = rendered(family)
    ids = torch.tensor(tokenizer.encode(text))
    masker = MaskerCache(MaskingOptions()).get(tokenizer)
    assert spans_of(tokenizer, ids, masker.mask(ids)) == expected


@pytest.mark.parametrize("family", ["pixtral", "qwen2-vl", "llama3.2-vision"])
def test_media_placeholders_are_never_trained(family):
    tokenizer = SyntheticTokenizer(TEMPLATES[family][1])
    ids = torch.tensor(tokenizer.encode(rendered(family)[0]))
    labels = MaskerCache(MaskingOptions(train_on_inputs=True)).get(tokenizer).mask(ids)
    media = {"[IMG]", "[IMG_BREAK]", "[IMG_END]", "<|image_pad|>", "<|image|>"}
    media_ids = torch.tensor([SPECIALS.index(t) for t in media])
    assert bool((labels[torch.isin(ids, media_ids)] == IGNORE_INDEX).all())
    assert int((labels != IGNORE_INDEX).sum()) == int((~torch.isin(ids, media_ids)).sum())
