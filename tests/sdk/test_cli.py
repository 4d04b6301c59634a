"""The ``formcast`` command line on the real SmolLM2 (shared engine, few short calls)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from formcast.cli import CliContext, app

PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40},
                   "age": {"type": "integer", "minimum": 0, "maximum": 130}},
    "required": ["name", "age"],
    "additionalProperties": False,
}

# Wide enough that no error message is wrapped inside rich's boxes.
RUNNER = CliRunner(env={"COLUMNS": "240"})

PERSON_MODULE = '''
from pydantic import BaseModel, Field

class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=130)
'''


@pytest.fixture
def cli(llm):
    """Invoke the CLI in-process with the session's model (no reload per command)."""
    def invoke(*args: str, code: int = 0):
        result = RUNNER.invoke(app, list(args), obj=CliContext(load=lambda model, **kw: llm))
        assert "Traceback" not in result.output, result.output
        assert result.exit_code == code, (result.exit_code, result.output, result.exception)
        return result

    return invoke


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- usage errors: exit code 2, a message, no traceback, no model load ----------------
@pytest.mark.parametrize(("args", "message"), [
    (["generate", "hi", "--regex", "a", "--choices", "a,b"], "at most one constraint"),
    (["generate", "hi", "--grammar", "/no/such.ebnf"], "cannot read"),
    (["generate", "hi", "--json-schema", "{not json"], "not valid JSON"),
    (["generate", "hi", "--json-schema", "[1, 2]"], "must be a JSON object"),
    (["generate", "hi", "--choices", " , "], "no choices"),
    (["generate", "hi", "--dtype", "float64"], "float64"),
    (["generate", "hi", "--max-tokens", "0"], "max-tokens"),
    (["extract", "--schema", "/no/such.json", "-i", "x.jsonl", "-o", "y.jsonl"], "cannot read"),
    (["extract", "--schema", "no_such_module_xyz:Person", "-i", "x", "-o", "y"], "cannot import"),
    (["extract", "--schema", "json:NoSuchClass", "-i", "x", "-o", "y"], "no attribute"),
    (["extract", "--schema", "json:dumps", "-i", "x", "-o", "y"], "not a class"),
    (["extract", "--schema", "Person", "-i", "x", "-o", "y"], "neither a .json file"),
    (["frobnicate"], "No such command"),
])
def test_usage_errors_exit_2_with_a_message(args, message):
    result = RUNNER.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_malformed_input_lines_are_named(tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(PERSON_SCHEMA))
    bad = tmp_path / "in.jsonl"
    bad.write_text('"fine"\n{"text": "also fine"}\n{oops\n')
    result = RUNNER.invoke(app, ["extract", "--schema", str(schema), "-i", str(bad),
                                      "-o", str(tmp_path / "out.jsonl")])
    assert result.exit_code == 2 and "in.jsonl:3 is not JSON" in result.output
    bad.write_text('{"body": "no text field"}\n')
    result = RUNNER.invoke(app, ["extract", "--schema", str(schema), "-i", str(bad),
                                      "-o", str(tmp_path / "out.jsonl")])
    assert result.exit_code == 2 and "'text'" in result.output


# The CLI run in a fresh interpreter, which then says whether torch was ever imported.
NO_TORCH_ENTRY = """
import sys
from formcast.cli import main
sys.argv[0] = "formcast"
try:
    main()
finally:
    print("torch imported:", "torch" in sys.modules, file=sys.stderr)
"""
UNSATISFIABLE = json.dumps({"type": "integer", "minimum": 5, "maximum": 3})
BAD_TYPE = json.dumps({"type": "object", "properties": {"age": {"type": "whole"}}})


@pytest.mark.parametrize(("args", "files", "message"), [
    (["generate", "hi", "--regex", "(unclosed"], {},
     "error: invalid regex '(unclosed': missing ), unterminated subpattern"),
    (["generate", "hi", "--json-schema", UNSATISFIABLE], {}, "error: #/minimum: no integer"),
    (["extract", "--schema", "bad.json", "-i", "in.jsonl", "-o", "out.jsonl"],
     {"bad.json": BAD_TYPE, "in.jsonl": '"Alice is 31."\n'}, "#/properties/age"),
    (["dataset", "--schema", "bad.json", "-n", "2", "-o", "out.jsonl"],
     {"bad.json": BAD_TYPE}, "#/properties/age"),
    (["eval", "task.jsonl", "--report", "r.json"],
     {"task.jsonl": json.dumps({"id": "q7", "prompt": "?", "answer": "1", "regex": "[0-9"})},
     "error: task item 'q7': invalid regex '[0-9'"),
])
def test_a_bad_constraint_fails_before_torch_or_the_model_loads(tmp_path, args, files, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    proc = subprocess.run([sys.executable, "-c", NO_TORCH_ENTRY, *args], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path, env={**os.environ,
                                                                     "COLUMNS": "240"})
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "torch imported: False" in proc.stderr
    assert not (tmp_path / "out.jsonl").exists() or not (tmp_path / "out.jsonl").read_text()


def test_python_dash_m_formcast_runs_the_cli():
    proc = subprocess.run([sys.executable, "-m", "formcast", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0
    for command in ("pull", "info", "generate", "extract"):
        assert command in proc.stdout


# -- with the model ------------------------------------------------------------------
slow = pytest.mark.slow


@slow
def test_pull_prints_the_cached_path(smollm2_gguf):
    result = RUNNER.invoke(app, ["pull", "smollm2"])
    assert result.exit_code == 0
    assert Path(result.stdout.strip()) == smollm2_gguf and smollm2_gguf.is_file()


@slow
def test_unknown_model_is_a_usage_error():
    result = RUNNER.invoke(app, ["pull", "no-such-model"])
    assert result.exit_code == 2 and "unknown model 'no-such-model'" in result.output


@slow
def test_info_reports_shape_runtime_cache_and_versions(cli, llm, smollm2_gguf):
    report = json.loads(cli("info", "--json").stdout)
    assert report["model"]["layers"] == llm.engine.model.config.num_hidden_layers == 30
    assert 130e6 < report["model"]["parameters"] < 140e6  # SmolLM2-135M
    assert report["tokenizer"]["vocab_size"] == llm.tokenizer.vocab_size
    assert report["runtime"]["device"] == "cpu" and report["runtime"]["dtype"] == "float32"
    assert str(smollm2_gguf) in report["cache"]["files"]
    assert {"formcast", "torch", "python"} <= set(report["versions"])
    table = cli("info").stdout
    assert "hidden_size" in table and "576" in table


@slow
def test_generate_free_text(cli):
    result = cli("generate", "What is the capital of France?", "--max-tokens", "12")
    assert "Paris" in result.stdout
    assert "completion tokens" in result.stderr and "completion tokens" not in result.stdout


@slow
def test_generate_with_regex_choices_and_json_schema(cli, tmp_path):
    pattern = r"\d{3}-\d{4}"
    out = cli("generate", "Make up a phone number.", "--regex", pattern, "--max-tokens", "16")
    assert re.fullmatch(pattern, out.stdout.rstrip("\n"))

    out = cli("generate", "Is the sky blue? Answer yes or no.", "--choices", "yes,no")
    assert out.stdout.strip() in {"yes", "no"}

    import jsonschema

    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON_SCHEMA))
    out = cli("generate", "Alice is 31 years old. Give her as JSON.", "--json-schema",
              str(schema), "--max-tokens", "40", "--temperature", "0.7", "--seed", "3")
    jsonschema.validate(json.loads(out.stdout), PERSON_SCHEMA)


@slow
def test_generate_with_an_ebnf_grammar_file(cli, tmp_path):
    grammar = tmp_path / "yesno.ebnf"
    grammar.write_text('root ::= "The answer is " ("yes" | "no") "."\n')
    out = cli("generate", "Is water wet?", "--grammar", str(grammar), "--max-tokens", "12")
    assert re.fullmatch(r"The answer is (yes|no)\.", out.stdout.rstrip("\n"))


@slow
def test_generate_runtime_and_constraint_failures(cli, tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON_SCHEMA))
    cut = cli("generate", "Alice is 31.", "--json-schema", str(schema), "--max-tokens", "3",
              code=1)
    assert "max_tokens" in cut.output and "partial output" in cut.output
    bad = cli("generate", "hi", "--regex", "(unclosed", code=2)
    assert "error:" in bad.output


@slow
def test_extract_writes_one_line_per_input_from_a_json_schema(cli, tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON_SCHEMA))
    texts = ["Alice Martin is 31 years old.", {"text": "Bob, aged 45, lives in Leeds."},
             "Carol turned 27 last week."]
    src = write_jsonl(tmp_path / "in.jsonl", texts)
    out = tmp_path / "out.jsonl"
    result = cli("extract", "--schema", str(schema), "-i", str(src), "-o", str(out),
                 "--batch-size", "2", "--max-tokens", "40")
    lines = read_jsonl(out)
    assert [line["index"] for line in lines] == [0, 1, 2]
    import jsonschema

    for line in lines:
        assert "data" in line, line
        jsonschema.validate(line["data"], PERSON_SCHEMA)
    assert lines[0]["data"]["name"].startswith("Alice")
    assert "3/3 extracted" in result.stderr


@slow
def test_extract_with_a_pydantic_class_records_failures_per_item(cli, tmp_path, monkeypatch):
    (tmp_path / "people_schema.py").write_text(PERSON_MODULE)
    monkeypatch.chdir(tmp_path)
    src = write_jsonl(tmp_path / "in.jsonl", ["Dan is 52.", "Eve is 19."])
    out = tmp_path / "out.jsonl"
    cli("extract", "--schema", "people_schema:Person", "-i", str(src), "-o", str(out),
        "--max-tokens", "40")
    lines = read_jsonl(out)
    assert len(lines) == 2 and all(set(line["data"]) == {"name", "age"} for line in lines)

    cut = tmp_path / "cut.jsonl"
    result = cli("extract", "--schema", f"{tmp_path / 'people_schema.py'}:Person", "-i",
                 str(src), "-o", str(cut), "--max-tokens", "2")
    lines = read_jsonl(cut)
    assert [line["index"] for line in lines] == [0, 1]
    for line in lines:
        assert line["error"]["type"] == "IncompleteOutputError"
        assert line["error"]["message"] and line["error"]["text"]
    assert "2 failed" in result.stderr
