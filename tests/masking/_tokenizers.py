"""Real tokenizers (copied from ../shared/tokenizers into tests/data/tokenizers), loaded once."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from tokenizer_data import tokenizer_dir

TOKENIZERS = Path(__file__).resolve().parents[1] / "data" / "tokenizers"


@functools.cache
def load_tokenizer(name: str):
    """The real tokenizer ``name`` (qwen3, llama3.1, gemma3, mistral-v3-sp)."""
    from transformers import AutoTokenizer

    if name == "mistral-v3-sp":
        pytest.importorskip("sentencepiece")
        pytest.importorskip("google.protobuf")  # transformers reads the .model through it
    return AutoTokenizer.from_pretrained(tokenizer_dir(name))
