"""Enum values a text names, and the per-text plan that holds date and enum fields to
the text (no model runs)."""

from __future__ import annotations

import datetime
import json
from typing import Literal

import pytest
from pydantic import BaseModel

from formcast.extraction import Extraction
from formcast.extraction_choices import enum_values, named_choices, narrowed

CODES = frozenset({"USD", "EUR", "GBP", "JPY"})
PERIODS = frozenset({"hour", "month", "year"})


@pytest.mark.parametrize("text, values, named", [
    ("costs 120 EUR", CODES, {"EUR"}),
    ("costs €120", CODES, {"EUR"}),
    ("25 eur, or $30", CODES, {"EUR", "USD"}),
    ("priced at ¥37,980", CODES, {"JPY"}),
    ("a SEURAT print", CODES, set()),               # a value inside a word names nothing
    ("no price given", CODES, set()),
    ("£43,482 per annum", PERIODS, {"year"}),
    ("paid hourly", PERIODS, {"hour"}),
    ("16 hours per week", PERIODS, set()),
    ("an Easy dish", frozenset({"easy", "hard"}), {"easy"}),
])
def test_named_choices(text, values, named):
    assert named_choices(text, values) == named


def test_enum_values_are_found_through_the_schema():
    schema = {"properties": {"a": {"enum": ["x", 1]}, "b": {"anyOf": [{"enum": ["y"]}]},
                             "c": {"const": "z", "default": "w"}}}
    assert enum_values(schema) == {"x", "y"}


class Offer(BaseModel):
    name: str
    currency: Literal["USD", "EUR"]
    kind: Literal["new", "used"] | None
    day: datetime.date


def _fields(schema: dict) -> dict:
    props = schema["properties"]
    return {"currency": props["currency"].get("enum"),
            "kind": props["kind"]["anyOf"][0].get("enum"),
            "day": props["day"].get("enum", props["day"].get("format"))}


@pytest.mark.parametrize("text, fields", [
    ("Lamp for 20 EUR, sale ends 3 May 2026.",
     {"currency": ["EUR"], "kind": ["new", "used"], "day": ["2026-05-03"]}),
    ("Lamp, used, $20, 04/03/2026.",
     {"currency": ["USD"], "kind": ["used"], "day": ["2026-04-03", "2026-03-04"]}),
    ("Lamp for 20 EUR.", {"currency": ["EUR"], "kind": ["new", "used"], "day": "date"}),
])
def test_narrowed_keeps_date_and_enum_fields_to_the_text(text, fields):
    schema = Offer.model_json_schema()
    schema = {**schema, "properties": {**schema["properties"],
                                       "kind": {"anyOf": [schema["properties"]["kind"]["anyOf"][0],
                                                          {"type": "null"}]}}}
    before = json.dumps(schema)
    assert _fields(narrowed(schema, text)) == fields
    assert json.dumps(schema) == before                  # the call's schema is untouched


def test_a_text_that_writes_neither_changes_nothing():
    assert narrowed(Offer.model_json_schema(), "Lamp for twenty.") is None


@pytest.mark.parametrize("grounding, narrowed_schema", [("auto", True), ("off", False)])
def test_each_text_gets_its_narrowed_schema_unless_grounding_is_off(
        grounding, narrowed_schema):
    from formcast import grammars
    from formcast.engine import load_tokenizer

    tokenizer = load_tokenizer("smollm2")
    job = Extraction(Offer, ["Lamp for 20 EUR, sale ends 3 May 2026."], grounding=grounding,
                     instructions=None)
    compiled = grammars.compile(job.spec.constraint, tokenizer)
    written = '{"name":"Lamp","currency":"USD","kind":null,"day":"2026-05-03"}'
    ids = tokenizer.encode(written, add_special_tokens=False)
    taken = job.matcher(0, compiled).valid_prefix(ids)
    assert (taken < len(ids)) is narrowed_schema         # USD: the text names EUR only
