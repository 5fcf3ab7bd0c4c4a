"""Paths of the real test tokenizers, unpacking the gzipped ones once per machine."""

from __future__ import annotations

import os

TOKENIZERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tokenizers")


def tokenizer_dir(name: str) -> str:
    """The folder of real tokenizer ``name``, with any ``*.gz`` file unpacked next to a copy.

    The largest tokenizer files are stored gzipped (the Gemma 3 ``tokenizer.json`` is 33 MB, 5 MB
    compressed) to keep the working tree small; they are unpacked once per machine.
    """
    import gzip
    import shutil
    import tempfile

    source = os.path.join(TOKENIZERS, name)
    packed = [f for f in os.listdir(source) if f.endswith(".gz")]
    if not packed:
        return source
    target = os.path.join(tempfile.gettempdir(), "autooffload-test-tokenizers", name)
    done = os.path.join(target, ".unpacked")
    if not os.path.exists(done):
        os.makedirs(target, exist_ok=True)
        for entry in os.listdir(source):
            path = os.path.join(source, entry)
            if entry.endswith(".gz"):
                with (
                    gzip.open(path, "rb") as src,
                    open(os.path.join(target, entry[:-3]), "wb") as dst,
                ):
                    shutil.copyfileobj(src, dst)
            else:
                shutil.copy(path, target)
        open(done, "w").close()
    return target
