"""What the single-file benchmarks share (``qlora_from_pretrained.py``, ``dpo_reference.py``):
the Llama-3.2-3B shape they build, the ``--cap`` parser, and one peer run in its own process."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

# Llama-3.2-3B's shape (tied embeddings, 128k vocabulary).
LLAMA_3B = dict(
    vocab_size=128_256,
    hidden_size=3072,
    intermediate_size=8192,
    num_hidden_layers=28,
    num_attention_heads=24,
    num_key_value_heads=8,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    rope_theta=500_000.0,
)


def parse_bytes(text: str) -> int:
    from autooffload.setting_values import parse_optional_bytes

    value = parse_optional_bytes(text, "--cap")
    assert value is not None
    return value


def run_peer(
    script: str, name: str, args: argparse.Namespace, keys: tuple[str, ...]
) -> tuple[dict, str]:
    """Run ``script --peer name`` with ``args``' ``keys`` in a fresh process: the ``RESULT``
    JSON line it prints (or the error it died with) and its stderr."""
    command = [sys.executable, script, "--peer", name]
    for key in keys:
        command += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ))
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if lines:
        result = json.loads(lines[-1][len("RESULT ") :])
    else:
        result = {"peer": name, "error": (done.stderr or done.stdout)[-2000:]}
    sys.stderr.write(done.stderr[-3000:] if done.returncode else "")
    return result, done.stderr
