"""What real-world schemas write and formcast once refused: one case per category.

ECMA-262 spellings Python's ``re`` cannot read (Unicode property classes, surrogate
pairs), patterns a mask cannot follow exactly (lookarounds, backreferences: widened
in the mask, checked at the end), a pattern alternative no JSON string can take
raw, references into places that are not schemas, and schemas over a megabyte.
"""

from __future__ import annotations

import json
import re
import warnings

import jsonschema
import jsonschema.validators
import pytest

from formcast.grammars import JsonSchema, explain
from formcast.grammars.schema_patterns import python_pattern

from .test_schema_semantics import accepts


def _oracle(schema: dict, text: str) -> bool:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema).is_valid(json.loads(text))


# (category, schema, valid documents, invalid documents)
CASES = [
    ("unicode-property-class", {"type": "string", "pattern": r"^[\p{L}\p{N}_]+$"},
     ['"abé_9"', '"Ω٣"'], ['"a b"', '"a-b"']),
    ("java-posix-class", {"type": "string", "pattern": r"^[\p{Graph}\x20]*$"},
     ['"a b!"'], ['"é"']),
    ("negated-property-class", {"type": "string", "pattern": r"^[^\p{C}]+$"},
     ['"ok é"'], ['""']),
    ("surrogate-pair-range", {"type": "string",
                              "pattern": r"^[\u0020-\uD7FF\uD800\uDC00-\uDBFF\uDFFF]*$"},
     ['"a😀"'], []),
    ("lookahead", {"type": "string", "pattern": r"^(?!aws:)[a-z:]+$"},
     ['"abc:d"', '"aw:s"'], ['"aws:x"', '"A"']),
    ("backreference", {"type": "string", "pattern": r"^(ab|cd)-\1$"},
     ['"ab-ab"', '"cd-cd"'], ['"ab-cd"', '"ab-"']),
    ("key-pattern-lookahead", {"type": "object", "patternProperties": {
        "^(?!x-)[a-z-]+$": {"type": "integer"}}, "additionalProperties": False},
     ['{"ab":1}'], ['{"x-a":1}', '{"ab":"s"}']),
    ("control-character-alternative", {"type": "string", "pattern": r"^\{(.|[\r\n])*\}$"},
     ['"{a}"'], ['"a"']),
    ("ref-into-unknown-keyword", {
        "$defs": {"group": {"inner": {"type": "integer"}}},
        "type": "object", "properties": {"a": {"$ref": "#/$defs/group/inner"}}},
     ['{"a":1}'], ['{"a":"s"}']),
    ("draft7-ref-into-array-items", {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "array", "items": [{"type": "string"}],
        "definitions": {"again": {"$ref": "#/items/0"}},
        "additionalItems": {"$ref": "#/definitions/again"}},
     ['["a","b"]'], ['["a",1]']),
]


@pytest.mark.parametrize("category,schema,valid,invalid", CASES, ids=[c[0] for c in CASES])
def test_real_world_categories_compile_and_follow_the_oracle(category, schema, valid, invalid,
                                                             compiler, tiny_vocab):
    oracle_schema = json.loads(json.dumps(schema))
    _python_patterns(oracle_schema)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for text in valid:
            assert _oracle(oracle_schema, text), f"table error: {text!r} is invalid"
            assert accepts(compiler, tiny_vocab, JsonSchema(schema), text), text
        for text in invalid:
            assert not _oracle(oracle_schema, text), f"table error: {text!r} is valid"
            assert not accepts(compiler, tiny_vocab, JsonSchema(schema), text), text


def _python_patterns(node) -> None:
    """The oracle (jsonschema, Python's re) reads the patterns in Python's spelling."""
    if isinstance(node, dict):
        if isinstance(node.get("pattern"), str):
            node["pattern"] = python_pattern(node["pattern"])
        if isinstance(node.get("patternProperties"), dict):
            node["patternProperties"] = {python_pattern(k): v
                                         for k, v in node["patternProperties"].items()}
        for value in node.values():
            _python_patterns(value)
    elif isinstance(node, list):
        for value in node:
            _python_patterns(value)


@pytest.mark.parametrize("ecma,python_matches,python_rejects", [
    (r"\p{Lu}\P{L}", ["A1", "É "], ["Ab", "a1"]),
    (r"[\p{Graph}]+", ["a!~"], ["a b", "é"]),
    (r"\u{1F600}", ["😀"], ["x"]),
    (r"(?<n>a)\k<n>", ["aa"], ["ab"]),
    (r"[\p{L}||\p{N}]", ["|", "a"], ["-"]),
])
def test_ecma_spellings_read_as_python(ecma, python_matches, python_rejects):
    compiled = re.compile(python_pattern(ecma))
    assert all(compiled.fullmatch(s) for s in python_matches)
    assert not any(compiled.fullmatch(s) for s in python_rejects)


@pytest.mark.parametrize("pattern,end_checked", [
    (r"^(?!aws:)[a-z:]+$", True),
    (r"^(a)\1$", True),
    (r"(?i)^abc$", True),
    (r"^[a-z]+$", False),
    (r"^[\p{L}]+$", False),
])
def test_explain_says_checked_at_the_end_only_with_an_end_check(pattern, end_checked,
                                                                compiler, tiny_vocab):
    schema = {"type": "string", "pattern": pattern}
    entry = next(i for i in explain(schema).items if i.keyword == "pattern")
    assert (entry.status == "end") == end_checked
    assert ("checked at the end" in entry.note) == end_checked
    compiled = compiler.compile(JsonSchema(schema), tiny_vocab)
    assert (compiled.end_check is not None) == end_checked


def test_a_schema_over_a_megabyte_compiles(compiler, tiny_vocab):
    schema = {"type": "object", "properties": {"a": {"type": "integer",
                                                     "description": "x" * (2 << 20)}}}
    assert len(json.dumps(schema)) > 1 << 20
    assert accepts(compiler, tiny_vocab, JsonSchema(schema), '{"a":1}')


def test_integer_multiple_of_beyond_the_mask_s_limit_is_checked_at_the_end(compiler,
                                                                          tiny_vocab):
    schema = {"type": "integer", "multipleOf": 2000}
    entry = next(i for i in explain(schema).items if i.keyword == "multipleOf")
    assert entry.status == "end"
    assert accepts(compiler, tiny_vocab, JsonSchema(schema), "4000")
    assert not accepts(compiler, tiny_vocab, JsonSchema(schema), "3")


def test_explain_and_the_compiled_coverage_list_the_compile_warnings(compiler, tiny_vocab):
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxlength": 3}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = explain(schema)
        compiled = compiler.compile(JsonSchema(schema), tiny_vocab)
    assert any("'maxlength'" in w and "'maxLength'" in w for w in report.warnings)
    assert "warning" in str(report) and "maxLength" in str(report)
    assert set(report.warnings) <= set(compiled.coverage.warnings)
    assert set(compiled.warnings) <= set(compiled.coverage.warnings)
