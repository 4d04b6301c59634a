"""explain(): keyword-by-keyword coverage, per backend, and what compiling does with it."""

from __future__ import annotations

import jsonschema
import pytest

from formcast import ConstraintError
from formcast.grammars import JsonSchema, explain

from .cases import PERSON

HOSTNAME_CHECKED = "hostname" in jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers
SCHEMA = {"title": "T", "type": "object", "additionalProperties": False, "required": ["a"],
          "properties": {
              "a": {"type": "integer", "minimum": 0, "multipleOf": 2},
              "b": {"type": "string", "pattern": "^x+$", "maxLength": 3},
              "c": {"type": "array", "items": {"type": "number"}, "uniqueItems": True},
              "d": {"oneOf": [{"type": "string", "format": "date"}, {"type": "null"}]},
              "e": {"type": "string", "format": "hostname"},
          }}


def _status(coverage, pointer: str, keyword: str) -> str:
    found = [i.status for i in coverage.items if i.pointer == pointer and i.keyword == keyword]
    assert len(found) == 1, (pointer, keyword, found)
    return found[0]


@pytest.mark.parametrize("pointer,keyword,xgrammar,outlines", [
    ("#", "title", "annotation", "annotation"),
    ("#", "required", "mask", "mask"),
    ("#/properties/a", "minimum", "mask", "end"),
    ("#/properties/a", "multipleOf", "end", "end"),     # xgrammar drops it next to a range
    ("#/properties/b", "pattern", "mask", "mask"),
    ("#/properties/b", "maxLength", "end", "end"),
    ("#/properties/c", "uniqueItems", "end", "end"),
    ("#/properties/d", "oneOf", "end", "end"),
    ("#/properties/d/oneOf/0", "format", "end", "end"),
    # jsonschema checks hostnames only when the optional fqdn package is installed
    ("#/properties/e", "format",
     *(("end", "end") if HOSTNAME_CHECKED else ("mask", "annotation"))),
])
def test_explain_statuses(pointer, keyword, xgrammar, outlines):
    assert _status(explain(SCHEMA), pointer, keyword) == xgrammar
    assert _status(explain(SCHEMA, backend="outlines-core"), pointer, keyword) == outlines


def test_explain_reports_the_absent_additional_properties_narrowing():
    coverage = explain(PERSON)
    notes = [i.note for i in coverage.items if i.keyword == "additionalProperties"]
    assert notes and "only the listed properties" in notes[0]
    assert "mask" in str(coverage) and "#/properties/age/minimum" in str(coverage)


def test_explain_accepts_json_text_and_rejects_bad_schemas():
    assert explain('{"type": "integer"}').items[0].status == "mask"
    with pytest.raises(ConstraintError, match="#/minimum"):
        explain({"type": "integer", "minimum": 3, "maximum": 1})
    with pytest.raises(ValueError, match="unknown backend"):
        explain({}, backend="nope")


def test_compiling_attaches_coverage_and_end_check(compiler, tiny_vocab):
    exact = compiler.compile(JsonSchema({"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 0}}, "required": ["n"]}), tiny_vocab)
    assert exact.coverage is not None and not exact.coverage.needs_end_check
    assert exact.end_check is None                        # every keyword is in the mask
    approx = compiler.compile(JsonSchema(PERSON), tiny_vocab, backend="outlines-core")
    assert approx.coverage.needs_end_check and approx.end_check is not None
    assert approx.end_check(b'{"name":"a","age":500}') is not None
    assert approx.end_check(b'{"name":"a","age":50}') is None


def test_unsupported_keywords_refuse_to_compile(compiler, tiny_vocab):
    schema = {**SCHEMA, "properties": {**SCHEMA["properties"],
                                       "f": {"type": "integer", "maximum": 2 ** 70}}}
    with pytest.raises(ConstraintError, match=r"#/properties/f/maximum"):
        compiler.compile(JsonSchema(schema), tiny_vocab)
    compiled = compiler.compile(JsonSchema(SCHEMA), tiny_vocab)     # xgrammar takes it all
    assert compiled.end_check is not None
