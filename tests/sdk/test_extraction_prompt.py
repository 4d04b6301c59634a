"""The extraction prompt and generation schema, without a model."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from formcast import grammars
from formcast.extraction import (MAX_FREE_STRING, cap_free_strings, extraction_messages,
                                 extraction_spec)


class Line(BaseModel):
    sku: str = Field(description="stock code")
    qty: int


class Address(BaseModel):
    city: str
    postcode: str | None = None


class Invoice(BaseModel):
    """An invoice."""

    number: str = Field(description="invoice number")
    status: Literal["paid", "open"]
    address: Address
    lines: list[Line]
    tags: list[str]


def test_prompt_is_one_user_turn_with_the_json_form_then_the_text():
    spec = extraction_spec(Invoice)
    messages = extraction_messages("  Invoice 42 for Leeds.  ", spec.json_schema,
                                   instructions="Dates as ISO 8601.")
    assert [m["role"] for m in messages] == ["user"]
    assert messages[0]["content"] == "\n".join([
        "Extract the information as JSON in this form:",
        "{",
        '  "number": <string>, // invoice number',
        '  "status": <one of "paid", "open">,',
        '  "address": {',
        '    "city": <string>,',
        '    "postcode": <string or null> // null if the text does not say',
        "  },",
        '  "lines": [',
        "    {",
        '      "sku": <string>, // stock code',
        '      "qty": <integer>',
        "    }",
        "  ],",
        '  "tags": <list of string>',
        "}",
        "",
        "Dates as ISO 8601.",
        "",
        "Text: Invoice 42 for Leeds.",
    ])


def test_recursive_schemas_render_to_a_bounded_depth():
    class Node(BaseModel):
        label: str
        child: "Node | None" = None

    spec = extraction_spec(Node)
    text = extraction_messages("a tree", spec.json_schema)[0]["content"]
    assert text.count('"label"') == 4  # the top object and three nested levels
    assert '"child": <object Node or null>' in text


def test_free_strings_are_capped_for_generation_only():
    schema = {"type": "object", "properties": {
        "free": {"type": "string"},
        "nullable": {"type": ["string", "null"]},
        "bounded": {"type": "string", "maxLength": 500},
        "long_min": {"type": "string", "minLength": 100},
        "pattern": {"type": "string", "pattern": "^[a-z]+$"},
        "dated": {"type": "string", "format": "date"},
        "choice": {"type": "string", "enum": ["a" * 80]},
        "nested": {"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
        "default": {"type": "string", "default": {"type": "string"}},
    }}
    capped = cap_free_strings(schema)
    props = capped["properties"]
    assert props["free"]["maxLength"] == MAX_FREE_STRING
    assert props["nullable"]["maxLength"] == MAX_FREE_STRING
    assert props["bounded"]["maxLength"] == 500
    assert props["long_min"]["maxLength"] == 100  # never below the schema's own minimum
    for key in ("pattern", "dated", "choice"):
        assert "maxLength" not in props[key], key
    assert props["nested"]["items"]["anyOf"][0]["maxLength"] == MAX_FREE_STRING
    assert props["default"]["default"] == {"type": "string"}  # data, not schema
    assert "maxLength" not in schema["properties"]["free"]  # the caller's schema is untouched


def test_spec_validates_against_the_callers_schema_not_the_capped_one():
    schema = {"type": "object", "required": ["bio"], "properties": {"bio": {"type": "string"}}}
    spec = extraction_spec(schema)
    assert isinstance(spec.constraint, grammars.JsonSchema)
    long_bio = json.dumps({"bio": "x" * 200})
    assert spec.parse(long_bio) == {"bio": "x" * 200}
    assert spec.json_schema is schema
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"bio": "x" * 200}, cap_free_strings(schema))


def test_extract_rejects_what_is_not_a_schema():
    with pytest.raises(TypeError, match="pydantic model, dataclass, TypedDict or JSON Schema"):
        extraction_spec(int)
