"""The command line's serving and packaging conventions: ``formcast serve``,
``--version``, ``--log-level``, ``--quantization``, constraints checked before the
model loads, and the ``py.typed`` marker."""

from __future__ import annotations

import importlib.resources
import json
import logging

import pytest
from typer.testing import CliRunner

import formcast
from formcast.cli import CliContext, app

RUNNER = CliRunner(env={"COLUMNS": "240"})  # (no message wrapped in rich's boxes)


def _no_load(model, **kwargs):
    raise AssertionError("the model must not be loaded")


def test_version():
    result = RUNNER.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"formcast {formcast.__version__}"


@pytest.mark.parametrize("args,message", [
    (["generate", "hi", "--regex", "(unclosed"], "invalid regex"),
    (["generate", "hi", "--json-schema", '{"type": "nonsense"}'], "#/type"),
    (["generate", "hi", "--json-schema", '{"type": "integer", "minimum": 3, "maximum": 1}'],
     "unsatisfiable"),
    (["generate", "hi", "--quantization", "int3"], "'int3' is not none, auto, int4"),
    (["--log-level", "loud", "generate", "hi"], "loud"),
    (["serve", "--quantization", "fp8"], "'fp8' is not one of none, auto, int4, int8, gguf"),
    (["serve", "--port", "0"], "port"),
])
def test_bad_options_and_constraints_fail_before_the_model_loads(args, message):
    result = RUNNER.invoke(app, args, obj=CliContext(load=_no_load))
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("schema,message", [
    ('{"type": "nonsense"}', "#/type"),
    ('{"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 1}},'
     ' "required": ["n"]}', "#/properties/n/minimum"),
    ('{"type": "object", "properties": {"a": {"$ref": "other.json#/x"}}}', "other.json"),
    ("json:JSONDecoder", "JSONDecoder"),
])
def test_extract_checks_its_schema_before_the_model_loads(tmp_path, schema, message):
    texts = tmp_path / "in.jsonl"
    texts.write_text('"Ada is 36."\n')
    if schema.startswith("{"):
        (tmp_path / "s.json").write_text(schema)
        schema = str(tmp_path / "s.json")
    result = RUNNER.invoke(app, ["extract", "--schema", schema, "-i", str(texts),
                                 "-o", str(tmp_path / "out.jsonl")],
                           obj=CliContext(load=_no_load))
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("level,logged", [("info", True), ("warning", False)])
def test_log_level_sets_what_the_cli_logs(caplog, level, logged):
    def load(model, **kwargs):
        raise RuntimeError("no model in this test")

    root = logging.getLogger()
    before = root.level
    try:
        with caplog.at_level(logging.NOTSET):  # (the CLI's level decides, not pytest's)
            result = RUNNER.invoke(app, ["--log-level", level, "generate", "hi", "--model", "m1"],
                                   obj=CliContext(load=load))
            assert root.level == getattr(logging, level.upper())
    finally:
        root.setLevel(before)
    assert result.exit_code == 1 and "no model in this test" in result.output
    lines = [r.getMessage() for r in caplog.records if r.name == "formcast.cli"]
    assert any(line.startswith("loading m1") for line in lines) is logged


def test_serve_help_lists_its_options():
    result = RUNNER.invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for option in ("--model", "--host", "--port", "--api-key", "FORMCAST_API_KEY",
                   "--max-concurrency", "--quantization", "--max-num-seqs"):
        assert option in result.stdout


@pytest.mark.parametrize("quantization,expected", [(None, "none"), ("none", "none")])
def test_info_reports_the_quantization_the_engine_uses(llm, quantization, expected):
    seen = {}

    def load(model, **kwargs):
        seen.update(kwargs)
        return llm

    args = ["info", "--json"] + (["--quantization", quantization] if quantization else [])
    result = RUNNER.invoke(app, args, obj=CliContext(load=load))
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["runtime"]["quantization"] == expected
    assert seen.get("quantization", "auto") == ("auto" if quantization is None else None)


@pytest.mark.slow
def test_info_reports_the_quantization_a_default_load_chose():
    # (the embedded GGUF is a Llama in Q4_1: "auto", the default, runs its blocks on the
    # native kernels, or packs its linears as int4 without them; one real load, as the
    # other quantizations load through the same path)
    from formcast.engine.kernels import native

    result = RUNNER.invoke(app, ["info", "--json", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["runtime"]["quantization"] == (
        "gguf" if native.available() else "int4")


def test_the_package_is_typed():
    assert importlib.resources.files("formcast").joinpath("py.typed").is_file()
