"""Enum values a text names, and the per-text plan that holds date and enum fields to
the text (no model runs)."""

from __future__ import annotations

import datetime
from typing import Literal

import pytest
from pydantic import BaseModel

from formcast.extraction import Extraction
from formcast.extraction_choices import enum_values, named_choices

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


@pytest.mark.parametrize("text, grounding, added, derived", [
    ("Lamp for 20 EUR, sale ends 3 May 2026.", "auto", {("currency",), ("day",)},
     ("2026-05-03", "EUR")),
    ("Lamp, used, $20.", "auto", {("currency",), ("kind",)}, ("USD", "used")),
    ("Lamp for twenty.", "auto", set(), ()),               # nothing named: model's choice
    ("Lamp for 20 EUR, sale ends 3 May 2026.", "off", set(), ()),
])
def test_each_text_holds_dates_and_choices_to_what_it_writes(text, grounding, added, derived):
    job = Extraction(Offer, [text], grounding=grounding, instructions=None)
    plan = job.text_plan(0)
    assert plan.strings - job.plan.strings == added
    assert plan.derived == derived
