"""Outputs cut at max_tokens: a loop is a RepetitionError naming what repeats."""

from __future__ import annotations

import pytest

import formcast
from formcast.repetition import find_repetition, incomplete_error


@pytest.mark.parametrize(("text", "repeated", "path"), [
    # a list that repeats its items until the budget runs out
    ('{"pros": ["light", "cheap", "light", "cheap", "li', '"light"', "/pros"),
    ('{"lines": [{"sku": "A1"}, {"sku": "A1"}, {"sku": "A', '{"sku": "A1"}', "/lines"),
    ('[3, 3, 3, 3', "3", "/"),
    # a string that repeats a few words
    ('{"title": "Gala Gala Gala Gala Gala Gala', " Gala", "/title"),
    ('{"code": "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx', "x", "/code"),
])
def test_a_looping_output_is_a_repetition_error_naming_the_value(text, repeated, path):
    error = incomplete_error(text, 256, "json")
    assert isinstance(error, formcast.RepetitionError)
    assert isinstance(error, formcast.IncompleteOutputError)  # old handlers still catch it
    assert (error.repeated, error.path, error.text) == (repeated, path, text)
    message = str(error)
    assert repeated in message and path in message
    assert "raise max_tokens" not in message
    assert any(fix in message for fix in ("maxItems", "maxLength"))


@pytest.mark.parametrize("text", [
    '{"name": "Maria Gonz',                        # simply cut short
    '{"tags": ["a", "a"], "name": "Maria Gonz',    # a closed list with a repeat is not the loop
    '{"note": "aaa',                               # too short to call a loop
])
def test_an_output_cut_short_says_raise_max_tokens(text):
    error = incomplete_error(text, 12, "json")
    assert type(error) is formcast.IncompleteOutputError
    assert "raise max_tokens" in str(error)
    assert find_repetition(text) is None
