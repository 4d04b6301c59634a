"""The README's Python examples run, in order, in one namespace (as a reader would)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_readme_has_the_two_commands_first():
    text = README.read_text(encoding="utf-8")
    first_block = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)
    assert [line.split("#")[0].strip() for line in first_block.strip().splitlines()] == \
        ["make demo", "make test"]


def test_readme_python_examples_run(capsys):
    blocks = python_blocks()
    assert len(blocks) >= 4
    namespace: dict = {"__name__": "readme"}
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"README.md block {i}", "exec"), namespace)
        except Exception as exc:
            raise AssertionError(f"README python block {i} failed:\n{block}") from exc
    printed = capsys.readouterr().out
    assert "John Smith" in printed
