"""Every script in examples/ runs as a user would run it and prints what it promises.

Each runs in a subprocess with this interpreter, from the repository root, so the
script's own folder is first on sys.path exactly as with ``python examples/x.py``.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import lark
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def run_example(name: str, timeout: float = 300) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLES / name)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stdout


def test_examples_folder_has_no_module_shadowing_an_installed_package():
    # A script's folder is first on sys.path: examples/regex.py would hide the
    # `regex` package (xgrammar -> transformers -> regex) from every example.
    import importlib.util

    for script in EXAMPLES.glob("*.py"):
        spec = importlib.util.find_spec(script.stem)
        assert spec is None or Path(spec.origin or "").parent == EXAMPLES, script.name


def test_extract_prints_typed_objects():
    out = run_example("extract.py")
    for cls in ("Contact(", "Person(", "Review(", "Recipe(", "Book("):
        assert cls in out
    assert re.search(r"stars=[1-5],", out)
    assert re.search(r"sentiment='(positive|negative|mixed)'", out)
    assert re.search(r"vegetarian=(True|False)", out)
    # values read from the text (grounded), not invented
    assert "servings=4, minutes=45" in out
    assert re.search(r"occupation='nurse'", out, flags=re.I)
    assert "5 typed objects in" in out


def test_regex_outputs_fully_match():
    out = run_example("regex_patterns.py")
    pairs = re.findall(r"^  /(.+)/ -> '(.*)'  fullmatch=", out, flags=re.M)
    assert len(pairs) == 5
    for pattern, text in pairs:
        assert re.fullmatch(pattern, text), (pattern, text)
    assert "all 5 outputs match their patterns" in out


def test_grammar_outputs_parse_with_lark():
    import importlib.util

    spec = importlib.util.spec_from_file_location("grammar_example", EXAMPLES / "grammar.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the grammars only; main() is not run on import
    out = run_example("grammar.py")
    expressions = re.findall(r"^    -> (.+?)   \(lark parses it; = (.+)\)$", out, flags=re.M)
    queries = re.findall(r"^    -> (.+?)   \(lark parses it\)$", out, flags=re.M)
    assert len(expressions) == 3 and len(queries) == 3
    arithmetic = lark.Lark(module.ARITHMETIC_LARK, parser="earley")
    sql = lark.Lark(module.SQL_LARK, parser="earley")
    for text, value in expressions:
        tree = arithmetic.parse(text)
        assert module.evaluate(tree) == pytest.approx(float(value), rel=1e-3)
    for text in queries:
        sql.parse(text)
        assert text.startswith("SELECT ") and text.endswith(";")


def test_choices_answers_are_among_the_choices():
    out = run_example("choices.py")
    labels = re.findall(r"^  (\w+)\s+<- ", out, flags=re.M)
    assert len(labels) == 4 and set(labels) <= {"positive", "negative", "neutral"}
    assert "What is the capital of Japan? -> Tokyo" in out


def test_stream_shows_growing_partials_then_the_final_object():
    out = run_example("stream.py")
    partials = [ast.literal_eval(m) for m in re.findall(r"partial: (\{.*\})$", out, flags=re.M)]
    assert len(partials) >= 3
    assert len(partials[-1]) >= len(partials[0])  # fields appear as they complete
    final = re.search(r"^final \((\d+) partial values before it\): Trip\((.*)\)$", out, flags=re.M)
    assert final and int(final.group(1)) == len(partials)
    assert "destination=" in final.group(2) and "activities=[" in final.group(2)


def test_batch_extracts_every_item_in_one_call():
    out = run_example("batch.py")
    # repr quotes with " when the value holds an apostrophe
    books = re.findall(r"^  Book\(title=(?:'.*'|\".*\"), author=(?:'.*'|\".*\"), year=(\d+)\)$",
                       out, flags=re.M)
    failed = re.findall(r"^  FAILED ", out, flags=re.M)
    assert len(books) + len(failed) == 8 and len(books) >= 6
    match = re.search(r"^(\d+)/8 extracted in one batch", out, flags=re.M)
    assert match and int(match.group(1)) == len(books)

