"""The enum values a text names: what a string ``enum`` field is grounded to.

Left to itself a small model picks the first or most common value of an enum
(currency ``USD`` for "120 EUR"). When the text names one or more of a field's
values, extraction holds the field to those (:func:`named_choices`); a field
whose values the text never names stays the model's choice.

A value is named when the text writes it as a word, in any case ("EUR", "eur",
"Easy"), or writes a common sign or word for it: currency signs and names for
ISO currency codes ("€", "euros": ``EUR``) and the adjectives of periods
("annual", "per annum": ``year``; "hourly": ``hour``).
"""

from __future__ import annotations

import re
from typing import Any

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
