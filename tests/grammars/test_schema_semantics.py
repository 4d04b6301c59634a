"""JSON Schema semantics per the spec, through the token-level protocol.

Each document is segmented into the tiny vocabulary's tokens and fed to a fresh
matcher token by token; it is accepted when every token is and the stop token is
allowed at the end. ``jsonschema`` is the oracle every table row is checked against.
"""

from __future__ import annotations

import json
import time
import warnings

import jsonschema
import jsonschema.validators
import pytest

from formcast import ConstraintError, grammars
from formcast.grammars import JsonSchema, explain

from .conftest import EOS, bit_set


def accepts(compiler, vocab, constraint: JsonSchema, text: str) -> bool:
    """Whether the compiled constraint takes ``text`` token by token, then stops."""
    compiled = compiler.compile(constraint, vocab)
    matcher, bitmask = compiled.matcher(), compiled.allocate_bitmask(1)
    tokens = vocab.segment(text.encode("utf-8"))
    assert tokens is not None
    for token in tokens:
        matcher.fill_bitmask(bitmask, 0)
        allowed = bit_set(bitmask, 0, token)
        accepted = matcher.accept(token)
        assert allowed == accepted, f"{text!r}: mask says {allowed}, accept says {accepted}"
        if not accepted:
            return False
    matcher.fill_bitmask(bitmask, 0)
    return bit_set(bitmask, 0, EOS) and matcher.accept(EOS)


def oracle(schema, text: str, default=jsonschema.Draft202012Validator) -> bool:
    cls = jsonschema.validators.validator_for(schema, default=default)
    return cls(schema, format_checker=cls.FORMAT_CHECKER).is_valid(json.loads(text))


D4 = "http://json-schema.org/draft-04/schema#"
D7 = "http://json-schema.org/draft-07/schema#"
D2019 = "https://json-schema.org/draft/2019-09/schema"

# (id, schema, valid documents, invalid documents)
TABLE = [
    # unknown keywords are annotations
    ("unknown-keywords", {"type": "object", "properties": {"a": {
        "type": "integer", "example": 3, "readonly": True, "preferredOrder": 1, "_format": "x"}},
        "ui_widget": "slider", "id": "person"},
     ['{"a":1}', "{}"], ['{"a":"x"}']),
    # $schema picks the draft; older keywords understood without it
    ("draft4-boolean-exclusive", {"$schema": D4, "type": "number", "minimum": 1,
                                  "exclusiveMinimum": True},
     ["2", "1.5"], ["1", "0"]),
    ("draft7-array-items", {"$schema": D7, "type": "array", "items": [
        {"type": "integer"}, {"type": "string"}], "additionalItems": False},
     ['[1,"a"]', "[1]"], ['[1,"a",2]', '["a"]']),
    ("draft2019-additional-items", {"$schema": D2019, "type": "array",
                                    "items": [{"type": "integer"}],
                                    "additionalItems": {"type": "string"}},
     ['[1,"a"]', "[]"], ["[1,2]"]),
    ("draft4-id-anchor", {"$schema": D4, "type": "object", "properties": {"a": {"$ref": "#foo"}},
                          "definitions": {"x": {"id": "#foo", "type": "integer"}}},
     ['{"a":1}'], ['{"a":"s"}']),
    ("no-schema-old-keywords", {"definitions": {"n": {"type": "integer"}}, "type": "object",
                                "properties": {"a": {"$ref": "#/definitions/n"},
                                               "b": {"type": "string"}},
                                "dependencies": {"a": ["b"]}},
     ['{"a":1,"b":"x"}', '{"b":"x"}'], ['{"a":1}', '{"a":"x","b":"y"}']),
    # keywords of a type-less schema apply to their type only
    ("typeless-maximum", {"maximum": 3}, ['"abc"', "2", "3", "{}"], ["3.5", "4"]),
    ("typeless-min-length", {"minLength": 2}, ["5", '"ab"', "[1]"], ['"a"']),
    ("typeless-pattern", {"pattern": "^a"}, ['"abc"', "1"], ['"b"']),
    ("typeless-min-items", {"minItems": 1}, ["[1]", '"x"'], ["[]"]),
    ("typeless-min-properties", {"minProperties": 1}, ['{"a":1}', "3"], ["{}"]),
    # $anchor / nested $id
    ("anchor-ref", {"$defs": {"a": {"$anchor": "foo", "type": "integer"}}, "$ref": "#foo"},
     ["1"], ['"s"']),
    ("nested-id-base", {"$id": "http://example.com/root.json", "$defs": {
        "A": {"$id": "nested/a.json", "type": "integer"},
        "B": {"$id": "nested/b.json", "$ref": "a.json"}}, "$ref": "nested/b.json"},
     ["1"], ['"x"']),
    # formats: unknown ones are annotations, known ones enforced
    ("unknown-format", {"type": "string", "format": "int32"}, ['"abc"'], ["1"]),
    ("known-format", {"type": "string", "format": "date"}, ['"2024-02-29"'],
     ['"hello"', '"2023-02-29"']),
    # fixes
    ("type-next-to-anyof", {"type": "string", "anyOf": [{"minLength": 3}, {"pattern": "^x"}]},
     ['"abc"', '"x"'], ['"ab"', "5"]),
    ("allof-unmergeable", {"allOf": [{"type": "string", "pattern": "a"}, {"pattern": "b"}]},
     ['"ab"', '"xbxa"'], ['"a"', '"b"']),
    ("allof-prefix-items-meaning", {"allOf": [{"prefixItems": [{}]},
                                              {"items": {"type": "integer"}}]},
     ["[1,2]", "[]"], ['["a",1]', '[1,"a"]']),
    ("pattern-properties-closed", {"type": "object", "patternProperties": {
        "^x": {"type": "integer"}}, "additionalProperties": False},
     ['{"xa":1}', "{}"], ['{"y":1}', '{"xa":"s"}']),
    ("anyof-only-required", {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}},
        "anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
     ['{"a":1,"b":2}', '{"b":2}', '{"a":1}'], ["{}"]),
    ("ref-with-siblings", {"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n",
                           "minimum": 3}, ["3"], ["2", '"a"']),
    ("enum-next-to-type", {"enum": [1, "a"], "type": "string"}, ['"a"'], ["1"]),
]


# Rows without $schema that use older keywords: the oracle reads them with this draft.
ORACLE_DRAFT = {"no-schema-old-keywords": jsonschema.Draft7Validator}


@pytest.mark.parametrize("id,schema,valid,invalid", TABLE, ids=[r[0] for r in TABLE])
def test_documents_follow_the_spec(id, schema, valid, invalid, compiler, tiny_vocab):
    default = ORACLE_DRAFT.get(id, jsonschema.Draft202012Validator)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for text in valid:
            assert oracle(schema, text, default), f"table error: {text!r} is invalid"
            assert accepts(compiler, tiny_vocab, JsonSchema(schema), text), text
        for text in invalid:
            assert not oracle(schema, text, default), f"table error: {text!r} is valid"
            assert not accepts(compiler, tiny_vocab, JsonSchema(schema), text), text


def test_unknown_keywords_are_listed_as_ignored_annotations():
    coverage = explain({"type": "object", "properties": {"a": {"type": "string",
                                                               "example": "x"}},
                        "readonly": True, "x-ui": 1})
    found = {(i.pointer, i.keyword): (i.status, i.note) for i in coverage.items}
    assert found[("#/properties/a", "example")] == ("annotation", "ignored")
    assert found[("#", "readonly")] == ("annotation", "ignored")
    assert found[("#", "x-ui")][0] == "annotation"


@pytest.mark.parametrize("typo,meant", [("maxlength", "maxLength"), ("minitems", "minItems"),
                                        ("requried", "required")])
def test_a_likely_typo_warns_once_naming_the_keyword(typo, meant):
    schema = {"type": "object", "properties": {"a": {typo: 3}, "b": {typo: 4}}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        coverage = explain(schema)
    relevant = [w for w in caught if typo in str(w.message)]
    assert len(relevant) == 1 and meant in str(relevant[0].message)
    assert all(i.status == "annotation" for i in coverage.items if i.keyword == typo)


def test_strict_closes_objects_and_strict_false_follows_the_spec(compiler, tiny_vocab):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert accepts(compiler, tiny_vocab, JsonSchema(schema), '{"a":1}')
    assert not accepts(compiler, tiny_vocab, JsonSchema(schema), '{"a":1,"b":2}')
    assert accepts(compiler, tiny_vocab, JsonSchema(schema, strict=False), '{"a":1,"b":2}')
    assert not accepts(compiler, tiny_vocab, JsonSchema(schema, strict=False), '{"a":"x"}')


def test_whitespace_inside_enum_objects_after_an_allof_merge(compiler, tiny_vocab):
    constraint = JsonSchema({"allOf": [{"enum": [{"a": [1, 2]}]}, {"type": "object"}]},
                            whitespace="flexible")
    for text in ('{"a":[1,2]}', '{"a": [1, 2]}', '{ "a" : [1,2] }'):
        assert accepts(compiler, tiny_vocab, constraint, text), text
    assert not accepts(compiler, tiny_vocab, constraint, '{"a": [1, 3]}')


@pytest.mark.parametrize("schema,where", [
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "#/allOf"),
    ({"not": {}}, "#/not"),
    ({"type": "object", "properties": {"a": {"not": {}}}, "required": ["a"]},
     "#/properties/a/not"),
    ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "#/required.*'a'"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"],
      "additionalProperties": False}, "#/required"),
    ({"type": "array", "allOf": [{"minItems": 3}, {"maxItems": 1}]}, "#/minItems"),
    ({"type": "string", "allOf": [{"minLength": 3}, {"maxLength": 1}]}, "#/minLength"),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": False,
      "minProperties": 2}, "#/minProperties"),
    ({"const": "a", "type": "integer"}, "#/const"),
    ({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                      "required": ["next"]}}, "$ref": "#/$defs/n"}, "recursion"),
])
def test_unsatisfiable_schemas_are_refused_naming_the_part(schema, where, compiler, tiny_vocab):
    with pytest.raises(ConstraintError, match=where.replace("$", r"\$")):
        compiler.compile(JsonSchema(schema), tiny_vocab)


def test_satisfiable_recursion_and_optional_empty_parts_compile(compiler, tiny_vocab):
    tree = {"$defs": {"n": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}}, "required": ["kids"]}},
        "$ref": "#/$defs/n"}
    assert accepts(compiler, tiny_vocab, JsonSchema(tree), '{"kids":[{"kids":[]}]}')
    optional = {"type": "object", "properties": {"a": False, "b": {"type": "integer"}}}
    assert accepts(compiler, tiny_vocab, JsonSchema(optional), '{"b":1}')
    assert not accepts(compiler, tiny_vocab, JsonSchema(optional, strict=False), '{"a":1}')


@pytest.mark.parametrize("schema,match", [
    ({"$ref": "https://example.com/s.json"}, "https://example.com/s.json"),
    ({"properties": {"a": {"$ref": "other.json#/x"}}}, "#/properties/a/\\$ref.*other.json"),
    ('{"type": "string",', "not valid JSON"),
])
def test_bad_references_and_text_are_constraint_errors(schema, match, compiler, tiny_vocab):
    with pytest.raises(ConstraintError, match=match):
        compiler.compile(JsonSchema(schema), tiny_vocab)


def test_deep_nesting_is_a_constraint_error_not_a_recursion_error(compiler, tiny_vocab):
    depth = 10_000
    text = '{"type":"array","items":' * depth + '{"type":"integer"}' + "}" * depth
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    for given in (text, schema):
        with pytest.raises(ConstraintError, match="nested"):
            compiler.compile(JsonSchema(given), tiny_vocab)
        with pytest.raises(ConstraintError, match="nested"):
            grammars.compile(JsonSchema(given), tiny_vocab)
        with pytest.raises(ConstraintError, match="nested"):
            explain(given)


def test_openapi_nullable_adds_null(compiler, tiny_vocab):
    for schema in ({"type": "string", "nullable": True},
                   {"type": "string", "enum": ["a"], "nullable": True}):
        assert accepts(compiler, tiny_vocab, JsonSchema(schema), '"a"')
        assert accepts(compiler, tiny_vocab, JsonSchema(schema), "null")
        assert not accepts(compiler, tiny_vocab, JsonSchema(schema), "1")


# (schema, a document violating a keyword explain() reports as checked at the end)
END_CHECKED = [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1,1]"),
    ({"oneOf": [{"type": "integer"}, {"minimum": 0}]}, "3"),
    ({"allOf": [{"type": "string", "pattern": "a"}, {"pattern": "b"}]}, '"a"'),
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}},
      "additionalProperties": {"type": "string"}}, '{"xa":"s"}'),
    ({"type": "string", "maxLength": 1000}, '"a\u0001b"'),
    ({"type": "object", "properties": {"a\"b": {"type": "integer"}}}, '{"a\\"b":"x"}'),
    ({"not": {"type": "string"}}, '"s"'),
]


@pytest.mark.parametrize("schema,violating", END_CHECKED)
def test_every_end_entry_has_an_end_check_that_rejects(schema, violating, compiler, tiny_vocab):
    compiled = compiler.compile(JsonSchema(schema, strict=False), tiny_vocab)
    assert compiled.coverage.with_status("end"), "the table expects an end-checked keyword"
    assert compiled.end_check is not None
    assert compiled.end_check(violating.encode()) is not None
    assert not accepts(compiler, tiny_vocab, JsonSchema(schema, strict=False), violating)


@pytest.mark.parametrize("schema", [r[1] for r in TABLE] + [s for s, _ in END_CHECKED])
def test_explain_says_end_only_with_an_end_check(schema, compiler, tiny_vocab):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = compiler.compile(JsonSchema(schema), tiny_vocab)
    assert bool(compiled.coverage.with_status("end")) == (compiled.end_check is not None)


@pytest.mark.parametrize("low,high", [(0, 5), (3, 100_000)])
def test_length_bounds_compile_fast_and_stay_exact(low, high, compiler, tiny_vocab):
    schema = {"type": "string", "minLength": low, "maxLength": high}
    start = time.perf_counter()
    compiler.compile(JsonSchema(schema), tiny_vocab)
    print(f"maxLength {high}: compiled in {time.perf_counter() - start:.3f} s")
    constraint = JsonSchema(schema)
    assert accepts(compiler, tiny_vocab, constraint, '"abcd"')
    assert not accepts(compiler, tiny_vocab, constraint, '"a\u0001b"')    # raw control char
    assert not accepts(compiler, tiny_vocab, constraint, '"a\tb"')
    too_short_or_long = '"ab"' if low else '"abcdef"'
    assert not accepts(compiler, tiny_vocab, constraint, too_short_or_long)


@pytest.mark.parametrize("pattern", ["^a", "^a.*$", "a", "[^x]"])
def test_patterns_follow_search_and_refuse_raw_control_characters(pattern, compiler,
                                                                   tiny_vocab):
    constraint = JsonSchema({"type": "string", "pattern": pattern})
    assert accepts(compiler, tiny_vocab, constraint, '"abc"')        # re.search: "abc" matches
    assert not accepts(compiler, tiny_vocab, constraint, '"a\u0001"')   # not JSON


def test_multiple_of_next_to_a_range_is_still_enforced(compiler, tiny_vocab):
    constraint = JsonSchema({"type": "integer", "minimum": 0, "multipleOf": 2})
    assert accepts(compiler, tiny_vocab, constraint, "4")
    assert not accepts(compiler, tiny_vocab, constraint, "3")
    assert not accepts(compiler, tiny_vocab, constraint, "-2")


@pytest.mark.parametrize("schema,valid,invalid", [
    ({"const": 1}, ["1", "1.0"], ["true", "2", "1.5"]),
    ({"enum": [0, False]}, ["0", "0.0", "false"], ["1", "true"]),
    ({"enum": [[1], "a"]}, ["[1]", "[1.0]", '"a"'], ["[true]", "[2]"]),
])
def test_whole_numbers_in_enums_take_either_spelling(schema, valid, invalid, compiler,
                                                     tiny_vocab):
    for text in valid:
        assert oracle(schema, text) and accepts(compiler, tiny_vocab, JsonSchema(schema), text)
    for text in invalid:
        assert not oracle(schema, text)
        assert not accepts(compiler, tiny_vocab, JsonSchema(schema), text)


def test_declared_2020_12_schema_still_understands_dependencies(compiler, tiny_vocab):
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema",
              "dependencies": {"bar": ["foo"], "baz": {"properties": {"foo": {"type": "integer"}}}}}
    constraint = JsonSchema(schema, strict=False)
    assert accepts(compiler, tiny_vocab, constraint, '{"bar":1,"foo":2}')
    assert not accepts(compiler, tiny_vocab, constraint, '{"bar":2}')
    assert not accepts(compiler, tiny_vocab, constraint, '{"baz":1,"foo":"x"}')
