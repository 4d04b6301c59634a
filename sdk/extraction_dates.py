"""The dates a text writes, in ISO form: what a ``format: date`` field is grounded to.

A small model copies a date well but converts one badly ("3 April 2025" became
``2025-03-04`` or a made-up day). Extraction therefore reads the text's dates
itself and lets a date field be one of them, written as the schema asks
(``YYYY-MM-DD``): the model still chooses which date, but can no longer invent one.

Read forms (English month names, full or abbreviated, any case):
``2025-04-03``, ``2025/04/03``, ``3 April 2025``, ``3rd of April, 2025``,
``April 3, 2025``, ``April 3rd 2025``, ``03.04.2025`` (day first), and
``04/03/2025`` (both readings, when both are days of the calendar). A date without
a year is not read: its year is not in the text.
"""

from __future__ import annotations

import datetime
import re

_MONTHS = {name: n for n, names in enumerate((
    ("january", "jan"), ("february", "feb"), ("march", "mar"), ("april", "apr"),
    ("may",), ("june", "jun"), ("july", "jul"), ("august", "aug"),
    ("september", "sep", "sept"), ("october", "oct"), ("november", "nov"),
    ("december", "dec")), 1) for name in names}
_MONTH = r"(?P<month>" + "|".join(sorted(_MONTHS, key=len, reverse=True)) + r")\.?"
_DAY = r"(?P<day>\d{1,2})(?:st|nd|rd|th)?"
_YEAR = r"(?P<year>\d{4})"
_FORMS = [re.compile(pattern, re.IGNORECASE) for pattern in (
    r"(?<!\d)" + _YEAR + r"[-/](?P<num_month>\d{1,2})[-/]" + r"(?P<day>\d{1,2})(?!\d)",
    r"(?<!\w)" + _DAY + r"(?:\s+of)?\s+" + _MONTH + r",?\s+" + _YEAR + r"(?!\d)",
    r"(?<!\w)" + _MONTH + r"\s+" + _DAY + r",?\s+" + _YEAR + r"(?!\d)",
    r"(?<![\d.])(?P<day>\d{1,2})\.(?P<num_month>\d{1,2})\.(?P<year>\d{4})(?!\d)",
)]
_SLASHED = re.compile(r"(?<![\d/])(\d{1,2})/(\d{1,2})/(\d{4})(?![\d/])")


def text_dates(text: str) -> tuple[str, ...]:
    """The calendar dates ``text`` writes with a day, a month and a year, as ISO
    ``YYYY-MM-DD`` strings, in the order they first appear, each once."""
    found: list[tuple[int, str]] = []
    for form in _FORMS:
        for match in form.finditer(text):
            groups = match.groupdict()
            month = (_MONTHS[groups["month"].lower()] if groups.get("month")
                     else int(groups["num_month"]))
            _add(found, match.start(), int(groups["year"]), month, int(groups["day"]))
    for match in _SLASHED.finditer(text):
        a, b, year = (int(g) for g in match.groups())
        _add(found, match.start(), year, a, b)   # month first (04/03: April 3) ...
        _add(found, match.start(), year, b, a)   # ... and day first (4 March)
    found.sort(key=lambda pair: pair[0])
    return tuple(dict.fromkeys(iso for _, iso in found))


def _add(found: list[tuple[int, str]], where: int, year: int, month: int, day: int) -> None:
    try:
        found.append((where, datetime.date(year, month, day).isoformat()))
    except ValueError:
        pass  # (not a day of the calendar: 31 April, month 13)
