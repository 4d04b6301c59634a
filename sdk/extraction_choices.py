"""The values a text leaves a date or enum field: its own dates, the enum values it names.

Left to itself a small model picks the first or most common value of an enum
(currency ``USD`` for "120 EUR") and converts dates badly ("14 July 2026" became
``1477-07-23``). :func:`narrowed` rewrites the generation schema for one text: a
string enum the text names values of keeps only those (:func:`named_choices`), a
``format: date`` string becomes an enum of the text's dates in ISO form
(:func:`~formcast.extraction_dates.text_dates`). The model still chooses among
them; a field the text gives nothing for stays the model's choice. (Whole values
as an enum, rather than spans of the text: a span that starts like a date but is
none, "14" of "14 July", would leave the date's pattern nowhere to go.)

A value is named when the text writes it as a word, in any case ("EUR", "eur",
"Easy"), or writes a common sign or word for it: currency signs and names for
ISO currency codes ("€", "euros": ``EUR``) and the adjectives of periods
("annual", "per annum": ``year``; "hourly": ``hour``).
"""

from __future__ import annotations

import copy
import re
from typing import Any

from formcast.extraction_dates import text_dates

# common ways of writing a value other than itself (a value of the schema is named
# by these only when the schema has that value)
_SYNONYMS: dict[str, tuple[str, ...]] = {
    "EUR": ("€", "euro", "euros"),
    "USD": ("$", "US$", "dollar", "dollars"),
    "GBP": ("£", "pound", "pounds", "sterling"),
    "JPY": ("¥", "yen", "円"),
    "CHF": ("Fr.", "francs"),
    "INR": ("₹", "rupees"),
    "year": ("annual", "annually", "per annum", "yearly", "a year"),
    "month": ("monthly", "a month"),
    "week": ("weekly", "a week"),
    "day": ("daily", "a day"),
    "hour": ("hourly", "an hour"),
}


def enum_values(schema: Any) -> frozenset[str]:
    """Every string value of an ``enum`` anywhere in ``schema``."""
    found: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            values = node.get("enum")
            if isinstance(values, list):
                found.update(v for v in values if isinstance(v, str))
            stack.extend(v for k, v in node.items() if k not in ("enum", "const", "default"))
        elif isinstance(node, list):
            stack.extend(node)
    return frozenset(found)


def named_choices(text: str, values: frozenset[str]) -> frozenset[str]:
    """The ``values`` that ``text`` names (see the module docstring)."""
    return frozenset(v for v in values if any(_names(text, form) for form in
                                              (v, *_SYNONYMS.get(v, ()))))


def _names(text: str, form: str) -> bool:
    if not form.strip():
        return False
    # (a sign such as "€" stands next to digits; a word must stand on its own)
    left = r"(?<!\w)" if form[0].isalnum() else ""
    right = r"(?!\w)" if form[-1].isalnum() else ""
    return re.search(left + re.escape(form) + right, text, re.IGNORECASE) is not None


def narrowed(schema: dict, text: str) -> dict | None:
    """A copy of ``schema`` whose date and enum fields keep to what ``text`` writes (see
    the module docstring), or None when the text changes nothing."""
    named = named_choices(text, enum_values(schema))
    dates = text_dates(text)
    if not (named or dates):
        return None
    out = copy.deepcopy(schema)
    changed = False
    stack: list[Any] = [out]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        values = node.get("enum")
        if isinstance(values, list) and all(isinstance(v, str) for v in values) \
                and named.intersection(values):
            node["enum"] = [v for v in values if v in named]
            changed = True
        elif dates and node.get("type") == "string" and node.get("format") == "date" \
                and not any(k in node for k in ("enum", "const", "pattern")):
            del node["format"]
            node["enum"] = list(dates)
            changed = True
        stack.extend(v for k, v in node.items() if k not in ("enum", "const", "default"))
    return out if changed else None
