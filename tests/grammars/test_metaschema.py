"""The flattened 2019-09/2020-12 metaschemas give jsonschema's own verdicts."""

from __future__ import annotations

import jsonschema
import pytest
from jsonschema.exceptions import SchemaError

from formcast.grammars.metaschema import check_schema

DRAFTS = [jsonschema.Draft202012Validator, jsonschema.Draft201909Validator]

VALID = [
    {},
    True,
    {"type": ["string", "null"], "maxLength": 3},
    {"$defs": {"a": {"type": "integer", "minimum": 0}}, "properties": {"x": {"$ref": "#/$defs/a"}}},
    {"definitions": {"a": {"enum": [1, "b", None]}}, "dependencies": {"a": ["b"], "c": {"required": ["d"]}}},
    {"prefixItems": [{"type": "string"}], "items": False, "contains": {"const": 3}, "minContains": 2},
    {"properties": {"$ref": {"type": "string"}, "$id": {}, "type": {}}},      # keyword-like names
    {"patternProperties": {"^x-": True}, "additionalProperties": {"not": {}}},
    {"anyOf": [{"required": ["a"]}, {"required": ["b"]}], "x-vendor": {"type": 5}},
    {"if": {"type": "string"}, "then": {"format": "email"}, "else": {"minimum": 1.5}},
    {"dependentRequired": {"a": ["b"]}, "dependentSchemas": {"a": {"minProperties": 1}}},
]

INVALID = [
    ({"type": "strnig"}, ["type"]),
    ({"minLength": -1}, ["minLength"]),
    ({"required": "a"}, ["required"]),
    ({"pattern": "("}, ["pattern"]),
    ({"properties": {"a": 3}}, ["properties", "a"]),
    ({"properties": {"a": {"properties": {"b": {"maxItems": 1.5}}}}}, ["properties", "a", "properties", "b", "maxItems"]),
    ({"$defs": {"a": {"type": 7}}}, ["$defs", "a", "type"]),
    ({"definitions": {"a": {"enum": 3}}}, ["definitions", "a", "enum"]),
    ({"allOf": []}, ["allOf"]),
    ({"anyOf": [{"type": "string"}, 4]}, ["anyOf", 1]),
    ({"items": {"uniqueItems": "yes"}}, ["items", "uniqueItems"]),
    ({"dependencies": {"a": [1]}}, ["dependencies", "a"]),
    ({"not": {"multipleOf": 0}}, ["not", "multipleOf"]),
    ({"additionalProperties": {"dependentRequired": {"a": "b"}}}, ["additionalProperties", "dependentRequired", "a"]),
    (3, []),
]


@pytest.mark.parametrize("draft", DRAFTS, ids=lambda d: d.__name__)
@pytest.mark.parametrize("schema", VALID)
def test_a_valid_schema_passes_as_it_does_with_jsonschema(schema, draft) -> None:
    draft.check_schema(schema)
    check_schema(schema, draft)


@pytest.mark.parametrize("draft", DRAFTS, ids=lambda d: d.__name__)
@pytest.mark.parametrize(("schema", "path"), INVALID)
def test_an_invalid_schema_fails_where_jsonschema_says(schema, path, draft) -> None:
    with pytest.raises(SchemaError) as expected:
        draft.check_schema(schema)
    with pytest.raises(SchemaError) as caught:
        check_schema(schema, draft)
    assert list(caught.value.path) == list(expected.value.path)
    assert list(caught.value.path)[:1] == path[:1]
