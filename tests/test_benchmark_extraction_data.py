"""The extraction benchmark's data and scoring (benchmarks/extraction_data.py): pure
functions and the texts' own consistency; no model runs."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "extraction_data.py"
_SPEC = importlib.util.spec_from_file_location("extraction_data", _PATH)
ed = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("extraction_data", ed)  # dataclasses resolve names through it
_SPEC.loader.exec_module(ed)


@pytest.mark.parametrize("predicted, gold, alternates, expected", [
    ({"a": "Oslo", "b": 3}, {"a": "oslo ", "b": 3.0}, {}, (2.0, 2)),
    ({"a": "Oslo, Norway", "b": 3}, {"a": "Oslo", "b": 3}, {}, (1.0, 2)),
    ({"a": "Bergen", "b": 3}, {"a": "Oslo", "b": 3}, {"a": ["Bergen"]}, (2.0, 2)),
    ({"a": None}, {"a": None}, {}, (1.0, 1)),
    ({"a": ""}, {"a": None}, {}, (0.0, 1)),
    ({"a": True}, {"a": 1}, {}, (0.0, 1)),
    # nested objects count leaf by leaf; a null object counts as one field
    ({"o": {"x": 1, "y": "z"}}, {"o": {"x": 1, "y": "Z"}}, {}, (2.0, 2)),
    ({"o": None}, {"o": {"x": 1, "y": "z"}}, {}, (0.0, 2)),
    ({"o": {"x": 1}}, {"o": None}, {}, (0.0, 1)),
    ({"o": None}, {"o": {"x": 1}}, {"o": [None]}, (1.0, 1)),
    # a list is one field: the share of items matched one to one, order free
    ({"l": ["b", "a"]}, {"l": ["a", "b"]}, {}, (1.0, 1)),
    ({"l": ["a", "a", "a", "a"]}, {"l": ["a", "b"]}, {}, (0.25, 1)),
    ({"l": []}, {"l": []}, {}, (1.0, 1)),
    ({"l": ["x"]}, {"l": []}, {}, (0.0, 1)),
    ({"l": ["Dr. Patel"]}, {"l": ["Patel"]}, {"l/0": ["Dr. Patel"]}, (1.0, 1)),
    ({"l": ["a"]}, {"l": ["a", "b"]}, {"l": [["a"]]}, (1.0, 1)),
    ({"l": [{"d": "tea", "q": 1}, {"d": "bun", "q": 3}]},
     {"l": [{"d": "tea", "q": 1}, {"d": "bun", "q": 2}]}, {}, (0.5, 1)),
    ({"l": [{"d": "Green tea", "q": 1}]}, {"l": [{"d": "tea", "q": 1}]},
     {"l/0/d": ["green tea"]}, (1.0, 1)),
])
def test_score_value(predicted, gold, alternates, expected):
    credit, fields = ed.score_value(predicted, gold, alternates)
    assert (pytest.approx(credit), fields) == expected


def test_an_invalid_output_scores_nothing():
    item = ed.Item(schema="Book", text="t", gold={"title": "t", "author": "a", "year": 1,
                                                  "pages": None})
    assert ed.score_item(item, None) == (0.0, 4)


@pytest.mark.parametrize("text, present, absent", [
    ("price 37,980 yen", [37980], [37.98, 980]),
    ("€1,699.50 or 4,95 EUR", [1699.5, 4.95], [1.6995]),
    ("Room 4.12 on 2026-07-14", [4.12, 2026, 7, 14], [412]),
    ("¥6,500,000 to ¥9,000,000", [6500000, 9000000], []),
    ("call 415-555-0187", [415, 555, 187], []),
    ("Five stars", [], [5]),
])
def test_numbers_in(text, present, absent):
    found = ed.numbers_in(text)
    assert all(x in found for x in present), found
    assert not any(x in found for x in absent), found


@pytest.mark.parametrize("value, expected", [
    # (strings not in the text, strings, numbers not in the text, numbers)
    ({"merchant": "Blue Door", "date": "2026-02-03", "items": [], "total": 9.25,
      "currency": "GBP"}, (0, 1, 0, 1)),
    ({"merchant": "Red Door", "date": "2026-02-03",
      "items": [{"description": "flat  WHITE", "quantity": 2, "unit_price": 1.99}],
      "total": 9.25, "currency": "USD"}, (1, 2, 1, 3)),
])
def test_hallucinations_count_plain_strings_and_numbers(value, expected):
    text = "BLUE DOOR CAFE, 3 Feb 2026: 2 x Flat White @ £3.20, TOTAL £9.25"
    assert ed.hallucinations(text, value, ed.Receipt) == expected


@pytest.fixture(scope="module")
def splits():
    return {name: ed.load_split(name) for name in ("tune", "heldout")}


def test_the_halves_are_stratified_by_schema(splits):
    tune, held = (Counter(it.schema for it in splits[n]) for n in ("tune", "heldout"))
    assert set(tune) == set(held) == set(ed.SCHEMAS)
    assert all(abs(tune[s] - held[s]) <= 1 for s in ed.SCHEMAS)
    assert sum(tune.values()) + sum(held.values()) >= 140
    texts = [it.text for n in splits for it in splits[n]]
    assert len(texts) == len(set(texts))


def test_gold_objects_are_spans_of_their_texts_and_score_full_marks(splits):
    for item in splits["tune"] + splits["heldout"]:
        model = ed.SCHEMAS[item.schema]
        gold = model.model_validate(item.gold).model_dump(mode="json")
        missing, strings, _, _ = ed.hallucinations(item.text, gold, model)
        assert missing == 0, item.text
        credit, fields = ed.score_item(item, gold)
        assert credit == pytest.approx(fields), item.text


@pytest.mark.parametrize("schema, gold, predicted, expected", [
    ("Event", {"title": "Fair", "date": "2026-04-20", "city": "Oslo", "venue": None},
     {"title": "Fair", "date": "2026-04-21", "city": "Oslo", "venue": "Hall"},
     {"string": (2.0, 2), "date": (0.0, 1), "null": (0.0, 1)}),
    ("Product", {"name": "X", "brand": "B", "price": 9.5, "currency": "EUR", "in_stock": True},
     {"name": "X", "brand": "B", "price": 9.5, "currency": "USD", "in_stock": True},
     {"string": (2.0, 2), "number": (1.0, 1), "enum": (0.0, 1), "bool": (1.0, 1)}),
    ("Review", {"product": "P", "rating": 4, "pros": ["a", "b"], "cons": []},
     None, {"string": (0.0, 1), "number": (0.0, 1), "list": (0.0, 2)}),
])
def test_score_kinds_splits_credit_by_kind_of_field(schema, gold, predicted, expected):
    item = ed.Item(schema=schema, text="t", gold=gold)
    assert ed.score_kinds(item, predicted) == expected
