"""The schema extraction generates under, and the value it gives back (no model)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import BaseModel

from formcast.extraction import (MAX_FREE_STRING, MAX_LIST_ITEMS, extraction_spec,
                                 generation_schema, lists_distinct, tidy)


def _array(**keywords) -> dict:
    return {"type": "object", "required": ["xs"],
            "properties": {"xs": {"type": "array", "items": {"type": "string"}, **keywords}}}


@pytest.mark.parametrize(("keywords", "max_items", "distinct"), [
    ({}, MAX_LIST_ITEMS, True),                       # no bound: capped, distinct
    ({"maxItems": 3}, 3, True),                       # the schema's own cap stays
    ({"maxItems": 500}, 500, True),
    ({"minItems": 40}, 40, False),                    # never below the minimum
    ({"uniqueItems": False}, MAX_LIST_ITEMS, False),  # the schema says repeats are fine
    ({"uniqueItems": True, "minItems": 2}, MAX_LIST_ITEMS, True),
])
def test_lists_are_capped_and_distinct_in_the_generation_schema(keywords, max_items, distinct):
    schema = _array(**keywords)
    gen = generation_schema(schema)
    xs = gen["properties"]["xs"]
    assert xs["maxItems"] == max_items
    assert lists_distinct(gen) is distinct
    # the matcher ends a list at its first repeat; uniqueItems itself would be end-checked
    assert "uniqueItems" not in xs
    assert schema == _array(**keywords)  # the caller's schema is untouched


@pytest.mark.parametrize(("schema", "min_items"), [
    (_array(), 1),                                    # required: at least one item
    (_array(minItems=0), 0),                          # the schema allows an empty list
    (_array(minItems=3), 3),
    ({**_array(), "required": []}, None),             # optional: may be null instead
])
def test_required_lists_get_one_item(schema, min_items):
    xs = generation_schema(schema)["properties"]["xs"]
    found = next((o for o in xs.get("anyOf", [xs]) if o.get("type") == "array"), xs)
    assert found.get("minItems") == min_items


def test_tuples_are_neither_capped_nor_distinct():
    schema = {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "integer"}]}
    gen = generation_schema(schema)
    assert "maxItems" not in gen and lists_distinct(gen)


@pytest.mark.parametrize(("value", "expected"), [
    ({"xs": ["a", "b", "a"]}, {"xs": ["a", "b"]}),    # the repeat that ended the list
    ({"xs": ["a", "a", "b", "b"]}, {"xs": ["a", "b"]}),
    ({"xs": []}, {"xs": []}),
    ({"xs": ["ARM", "ARM ", " C"]}, {"xs": ["ARM", "C"]}),   # stripped, then distinct
])
def test_tidy_drops_repeated_items_of_distinct_lists(value, expected):
    assert tidy(value, generation_schema(_array())) == expected
    assert tidy(json.loads(json.dumps(value)), generation_schema(_array(uniqueItems=False))) \
        == value


class Address(BaseModel):
    city: str
    postcode: str | None = None   # optional and nullable
    floor: int = 0                # optional, null not allowed


class Person(BaseModel):
    name: str
    age: int | None               # required, nullable
    homes: list[Address]


def test_optional_fields_are_always_written_and_may_be_null():
    gen = generation_schema(Person.model_json_schema())
    address = gen["$defs"]["Address"]
    assert sorted(address["required"]) == ["city", "floor", "postcode"]
    for value in ({"city": "Oslo", "postcode": None, "floor": None},
                  {"city": "Oslo", "postcode": "0150", "floor": 3}):
        jsonschema.validate({"name": "Ada", "age": None, "homes": [value]}, gen)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "Ada", "age": None, "homes": [{"city": None}]}, gen)


@pytest.mark.parametrize(("generated", "expected"), [
    # a null the schema allows stays; one it does not is dropped, so the default applies
    ({"name": "Ada", "age": None, "homes": [{"city": "Oslo", "postcode": None, "floor": None}]},
     Person(name="Ada", age=None, homes=[Address(city="Oslo")])),
    ({"name": "Ada", "age": 36, "homes": [{"city": "Oslo", "postcode": "0150", "floor": 2},
                                          {"city": "Oslo", "postcode": "0150", "floor": 2}]},
     Person(name="Ada", age=36, homes=[Address(city="Oslo", postcode="0150", floor=2)])),
])
def test_extraction_spec_parses_the_tidied_value(generated, expected):
    assert extraction_spec(Person).parse(json.dumps(generated)) == expected


@pytest.mark.parametrize(("prop", "grounded", "cap"), [
    ({"type": "string"}, False, MAX_FREE_STRING),
    ({"type": "string"}, True, None),                          # a span ends where the text does
    ({"type": "string", "x-grounded": False}, True, MAX_FREE_STRING),
    ({"type": "string", "maxLength": 8}, True, 8),             # the schema's own bound stays
])
def test_grounded_strings_are_not_capped(prop, grounded, cap):
    schema = {"type": "object", "properties": {"s": prop}, "required": ["s"]}
    gen = generation_schema(schema, grounded=grounded)
    assert gen["properties"]["s"].get("maxLength") == cap


class Event(BaseModel):
    title: str
    city: str
    venue: str | None
    host: str | None


@pytest.mark.parametrize(("generated", "expected"), [
    ({"title": "Food Fair", "city": "Oslo", "venue": "food fair", "host": "Ana"},
     {"title": "Food Fair", "city": "Oslo", "venue": None, "host": "Ana"}),
    ({"title": "Food Fair", "city": "Oslo", "venue": "Hall", "host": "Hall"},
     {"title": "Food Fair", "city": "Oslo", "venue": "Hall", "host": None}),  # the later one
    ({"title": "Fair", "city": "Oslo", "venue": "Oslo Hall", "host": None},
     {"title": "Fair", "city": "Oslo", "venue": "Oslo Hall", "host": None}),  # not a copy
    ({"title": "Oslo", "city": "Oslo", "venue": None, "host": None},
     {"title": "Oslo", "city": "Oslo", "venue": None, "host": None}),  # required ones stay
])
def test_tidy_nulls_optional_fields_that_copy_another(generated, expected):
    assert tidy(generated, generation_schema(Event.model_json_schema())) == expected


class Review(BaseModel):
    pros: list[str]
    cons: list[str]
    tags: list[int]


@pytest.mark.parametrize(("generated", "expected"), [
    ({"pros": ["quiet", "fast"], "cons": ["Quiet", "loud"], "tags": []},
     {"pros": ["quiet", "fast"], "cons": ["loud"], "tags": []}),
    ({"pros": ["quiet"], "cons": ["quiet"], "tags": [1]},
     {"pros": ["quiet"], "cons": [], "tags": [1]}),
    ({"pros": [], "cons": ["loud"], "tags": [2, 2]}, {"pros": [], "cons": ["loud"], "tags": [2]}),
])
def test_tidy_drops_list_items_an_earlier_list_holds(generated, expected):
    assert tidy(generated, generation_schema(Review.model_json_schema())) == expected
