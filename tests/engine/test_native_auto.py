"""``quantization="auto"`` on the CPU: a plain Llama GGUF in block types the native
kernels run goes on them as stored ("gguf"); without the extension it falls back
to int4 (4-bit files), and files the native step does not run keep int4/int8."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from formcast.engine import Engine, SamplingParams
from formcast.engine.kernels import native
from tests.engine.model_families import reference, write_gguf

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]


def _llama_gguf(tmp_path: Path, qtype: str, window: int | None) -> Path:
    """A tiny Llama-architecture GGUF (the Mistral reference, written as "llama")."""
    model = reference(transformers, "mistral")
    model.config.sliding_window = window
    path = tmp_path / f"llama-{qtype}-{window}.gguf"
    write_gguf(path, model, "mistral", qtype, tokenizer=True)
    return path


@pytest.mark.skipif(not native.available(), reason="the native CPU kernels did not build")
@pytest.mark.parametrize("qtype, window, expected", [
    ("Q4_0", None, "gguf"),
    ("Q8_0", None, "gguf"),
    ("F32", None, None),  # (float matrices: nothing to run as blocks)
    ("Q4_0", 8, "int4"),  # (a sliding window makes it a Mistral: not the plain Llama step)
])
def test_auto_runs_a_plain_llama_gguf_on_the_native_kernels(tmp_path: Path, qtype: str,
                                                            window: int | None,
                                                            expected: str | None) -> None:
    engine = Engine.from_pretrained(str(_llama_gguf(tmp_path, qtype, window)), device="cpu",
                                    spec="none")
    assert engine.quantization == expected
    out = engine.generate([[3, 5, 7, 9]], SamplingParams(max_tokens=4, temperature=0.0,
                                                          ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_auto_falls_back_to_int4_with_the_extension_off(tmp_path: Path) -> None:
    path = _llama_gguf(tmp_path, "Q4_0", None)
    code = textwrap.dedent(f"""
        from formcast.engine import Engine
        from formcast.engine.kernels import native
        assert not native.available()
        print(Engine.from_pretrained({str(path)!r}, device="cpu", spec="none").quantization)
    """)
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "FORMCAST_NATIVE": "0"},
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["int4"]
