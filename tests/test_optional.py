"""bitsandbytes is optional (the ``qlora`` extra): never imported by enable(), imported quietly
where QLoRA needs it, and a missing install is an error naming the extra."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import BitsAndBytesConfig, LlamaForCausalLM

import autooffload
from autooffload.errors import AutoOffloadError, MissingExtraError
from autooffload.optional import import_bitsandbytes

REPO = Path(__file__).resolve().parents[1]


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )


def test_import_and_enable_do_not_import_bitsandbytes():
    result = _python(
        """
        import sys
        import transformers
        import autooffload
        autooffload.enable()
        print("bitsandbytes" in sys.modules)
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"
    assert "bitsandbytes" not in result.stderr


def test_bitsandbytes_imports_without_its_cpu_kernel_notice():
    pytest.importorskip("bitsandbytes")
    result = _python(
        """
        import sys
        from autooffload.optional import import_bitsandbytes
        import_bitsandbytes()
        print("bitsandbytes" in sys.modules)
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "True"
    assert "Failed to load CPU gemm_4bit_forward" not in result.stderr


def test_missing_bitsandbytes_is_an_error_naming_the_qlora_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(MissingExtraError, match=r'pip install "autooffload\[qlora\]"') as caught:
        import_bitsandbytes()
    assert isinstance(caught.value, AutoOffloadError)
    assert isinstance(caught.value, ImportError)


def test_quantized_from_pretrained_without_bitsandbytes_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    autooffload.enable(device="cpu")
    try:
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
        with pytest.raises(MissingExtraError, match=r"autooffload\[qlora\]"):
            LlamaForCausalLM.from_pretrained(tmp_path, quantization_config=config)
    finally:
        autooffload.disable()
