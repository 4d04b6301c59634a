"""The dates a text writes, read into ISO form for date fields (no model runs)."""

from __future__ import annotations

import pytest

from formcast.extraction_dates import text_dates


@pytest.mark.parametrize("text, dates", [
    ("Kick-off is on 2026-04-20 in Boston.", ("2026-04-20",)),
    ("Join us on 3 April 2025 at noon", ("2025-04-03",)),
    ("Monday, November 16, 2026, at 4 pm", ("2026-11-16",)),
    ("the 21st of June, 2027", ("2027-06-21",)),
    ("Due Sept. 9 2024 or 1 Oct 2024", ("2024-09-09", "2024-10-01")),
    ("paid on 14.07.2026", ("2026-07-14",)),
    ("signed 04/03/2025", ("2025-04-03", "2025-03-04")),   # both readings
    ("signed 04/23/2025", ("2025-04-23",)),                # only one is a day
    ("on 31 April 2025", ()),                              # no such day
    ("on Friday 13 March", ()),                            # no year written
    ("version 2025-13-01 and 12 Mayfair 2025", ()),
    ("3 May 2025, again 2025-05-03", ("2025-05-03",)),
])
def test_text_dates(text, dates):
    assert text_dates(text) == dates
