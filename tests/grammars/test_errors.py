"""Bad constraints fail at compile time with a ConstraintError naming the location."""

from __future__ import annotations

import json
import time

import pytest

from formcast import ConstraintError
from formcast.grammars import Choice, Ebnf, JsonSchema, Lark, Regex
from formcast.grammars.cache import Failure

BAD = [
    # (constraint, backend, substrings the message must contain)
    (Regex("("), "auto", ["position 0", "missing )"]),
    (Regex(r"[z-a]"), "auto", ["position 1", "bad character range"]),
    (Regex(r"a(?=b)"), "auto", ["lookahead"]),
    (Regex(r"(a)\1"), "auto", ["backreference"]),
    (Regex(r"a\bb"), "auto", ["word boundary"]),
    (Regex(r"(?i)abc"), "auto", ["case-insensitive"]),
    (Regex(r"a$b"), "outlines-core", ["anchor"]),
    (JsonSchema('{"type": "object",'), "auto", ["not valid JSON", "line 1:"]),
    (JsonSchema({"type": "strnig"}), "auto", ["#/type", "invalid JSON Schema"]),
    (JsonSchema({"properties": {"a": {"minimum": "x"}}}), "auto",
     ["#/properties/a/minimum"]),
    (JsonSchema({"type": "integer", "minimum": 5, "maximum": 2}), "auto",
     ["#/minimum", "unsatisfiable"]),
    (JsonSchema({"type": "integer", "minimum": 1.2, "maximum": 1.8}), "auto",
     ["#/minimum", "no integer"]),
    (JsonSchema({"properties": {"n": {"type": "number", "exclusiveMinimum": 1,
                                      "maximum": 1}}}), "auto",
     ["#/properties/n/exclusiveMinimum"]),
    (JsonSchema({"type": "string", "minLength": 3, "maxLength": 2}), "outlines-core",
     ["#/minLength"]),
    (JsonSchema({"type": "array", "minItems": 3, "maxItems": 1}), "auto", ["#/minItems"]),
    (JsonSchema({"type": "object", "properties": {"c": {"enum": []}}}), "auto",
     ["#/properties/c/enum"]),
    (JsonSchema({"type": "string", "enum": [1, 2]}), "auto", ["#/enum", "no enum value"]),
    (JsonSchema({"type": "object", "properties": {"a": {}}, "required": ["b"],
                 "additionalProperties": False}), "auto",
     ["#/required", "'b' is not allowed"]),
    (JsonSchema({"$ref": "#/$defs/missing"}), "auto", ["#/$ref", "does not resolve"]),
    (JsonSchema({"$ref": "https://example.com/s.json"}), "auto", ["#/$ref", "not local"]),
    (JsonSchema({"type": "integer", "maximum": 2 ** 70}), "xgrammar", ["#/maximum", "2**63"]),
    (JsonSchema({"type": "array", "prefixItems": [{}, {}], "maxItems": 1}), "xgrammar",
     ["#/maxItems", "prefixItems"]),
    (JsonSchema(False), "auto", ["accepts no document"]),
    (Ebnf('root ::= "a" |'), "auto", ["line 1, column 15"]),
    (Ebnf('root ::= "a" b'), "auto", ['Rule "b" is not defined', "line 1, column 14"]),
    (Ebnf('root ::= "a"\nitem ::= [z-a]'), "auto", ["line 2"]),
    (Ebnf('start ::= "a"'), "auto", ['"root" is not found']),
    (Ebnf('start ::= "a"', root="begin"), "auto", ['"begin"']),
    (Lark('start: "a" b'), "auto", ["line 1, column 12", "unknown name 'b'"]),
    (Ebnf('root ::= "a"'), "outlines-core", ["does not compile ebnf"]),
    (JsonSchema({"title": "anything"}), "outlines-core", ["unconstrained"]),
    (Lark('start: "a"'), "outlines-core", ["does not compile lark"]),
]


@pytest.mark.parametrize("constraint,backend,expect", BAD,
                         ids=[f"{i}-{type(c).__name__}" for i, (c, _, _) in enumerate(BAD)])
def test_bad_constraint_names_the_location(constraint, backend, expect, compiler, tiny_vocab):
    with pytest.raises(ConstraintError) as info:
        compiler.compile(constraint, tiny_vocab, backend=backend)
    for part in expect:
        assert part in str(info.value), f"{part!r} not in {str(info.value)!r}"


def test_unsupported_keywords_are_listed_together(compiler, tiny_vocab):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 2 ** 70},
                                               "b": {"type": "array", "prefixItems": [{}, {}],
                                                     "maxItems": 1}},
              "x-note": "an annotation", "colour": "red"}
    with pytest.raises(ConstraintError) as info:
        compiler.compile(JsonSchema(schema), tiny_vocab)
    message = str(info.value)
    assert "#/properties/a/maximum" in message and "#/properties/b/maxItems" in message
    assert "x-note" not in message and "colour" not in message


def test_huge_schema_is_refused(compiler, tiny_vocab):
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string",
                                                         "description": "x" * 2000}
                                                for i in range(4500)}}
    assert len(json.dumps(schema)) > 8 << 20
    with pytest.raises(ConstraintError, match="at most"):
        compiler.compile(JsonSchema(schema), tiny_vocab)


def test_failures_are_cached_and_fail_fast(compiler, tiny_vocab):
    bad = JsonSchema({"type": "integer", "minimum": 9, "maximum": 1, "title": "cache-me"})
    with pytest.raises(ConstraintError) as first:
        compiler.compile(bad, tiny_vocab)
    key = (tiny_vocab.fingerprint, "xgrammar", bad.kind, bad.canonical_text)
    assert isinstance(compiler.cache.get(key), Failure)
    start = time.perf_counter()
    with pytest.raises(ConstraintError) as again:
        compiler.compile(bad, tiny_vocab)
    assert time.perf_counter() - start < 0.05
    assert str(again.value) == str(first.value)


@pytest.mark.parametrize("make,expect", [
    (lambda: Choice([]), "at least one option"),
    (lambda: Choice(["a", "b", "a"]), "option 2 ('a') repeats an earlier option"),
    (lambda: Choice(["a", ""]), "option 1 must be a non-empty str"),
    (lambda: Choice("ab"), "sequence of strings, got str"),
    (lambda: Choice(None), "sequence of strings, got NoneType"),
    (lambda: JsonSchema({}, max_whitespace=3), "only applies to whitespace='flexible'"),
    (lambda: JsonSchema({}, whitespace="flexible", max_whitespace=0), "1..64, got 0"),
    (lambda: JsonSchema({}, whitespace="pretty"), "got 'pretty'"),
    (lambda: JsonSchema(42), "dict, a bool or JSON text, got int"),
    (lambda: JsonSchema(None), "got NoneType"),
    (lambda: JsonSchema({"a": {1, 2}}).canonical_text, "not JSON-serialisable"),
    (lambda: Regex(b"a"), "must be a str, got bytes"),
    (lambda: Regex(None), "must be a str, got NoneType"),
    (lambda: Ebnf("root ::= a", root=""), "non-empty root rule name"),
    (lambda: Lark(None), "must be a str, got NoneType"),
])
def test_malformed_arguments_raise_constraint_error(make, expect):
    with pytest.raises(ConstraintError) as info:
        make()
    assert expect in str(info.value)
    assert isinstance(info.value, ValueError)   # except ValueError code keeps working


@pytest.mark.parametrize("thing", [None, "a+", {"type": "string"}])
def test_compiling_what_is_not_a_constraint_is_a_constraint_error(thing, compiler, tiny_vocab):
    with pytest.raises(ConstraintError, match="not a formcast constraint"):
        compiler.compile(thing, tiny_vocab)


def test_unknown_backend_and_vocab_size(compiler, tiny_vocab, smollm2_tokenizer):
    with pytest.raises(ValueError, match="unknown grammar backend"):
        compiler.compile(Regex("a"), tiny_vocab, backend="llama.cpp")
    with pytest.raises(ValueError, match="smaller than"):
        compiler.compile(Regex("a"), smollm2_tokenizer, vocab_size=100)
