"""Whether an output cut at ``max_tokens`` was looping, and on what.

A small model under a grammar can repeat itself until the token budget runs out:
the same list item again and again, or the same few words inside a string. When
that is why a constrained output is incomplete, the caller needs to bound the part
that loops, not a larger ``max_tokens``. :func:`find_repetition` reads the partial
output and names the repeated value.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from formcast.errors import IncompleteOutputError, RepetitionError
from formcast.partial_json import parse_partial

@dataclass(frozen=True, kw_only=True)
class Repetition:
    """A repeated value in a partial output.

    Attributes
    ----------
    repeated : str
        The repeated list item (as JSON) or text.
    path : str
        JSON pointer of the list that repeats an item, or of the value whose text
        repeats ("" when the output is not JSON).
    kind : str
        "item" (a list repeats one of its items) or "text" (a run of text repeats).
    """

    repeated: str
    path: str
    kind: str

    def advice(self) -> str:
        """What to change so the output ends (one sentence)."""
        where = self.path or "the output"
        if self.kind == "item":
            return (f"the list at {where} repeats the item {self.repeated}; bound it with "
                    f"maxItems or uniqueItems (a set, or a shorter list type)")
        return (f"{where} repeats {self.repeated!r}; bound it with maxLength (a shorter "
                f"field), or a Literal/enum when its values are known")


def incomplete_error(text: str, num_tokens: int, kind: str) -> IncompleteOutputError:
    """The error of a constrained output cut at ``max_tokens`` after ``num_tokens``.

    A :class:`RepetitionError` naming the repeated value and what to bound when the
    output was looping (a larger ``max_tokens`` would not end it); otherwise an
    :class:`IncompleteOutputError` saying to raise ``max_tokens``.
    """
    loop = find_repetition(text)
    if loop is None:
        return IncompleteOutputError(f"output cut at max_tokens ({num_tokens} tokens) before "
                                     f"the {kind} was complete; raise max_tokens", text=text)
    return RepetitionError(f"output cut at max_tokens ({num_tokens} tokens) while repeating "
                           f"itself: {loop.advice()}", text=text, repeated=loop.repeated,
                           path=loop.path)


def find_repetition(text: str, *, min_repeats: int = 3, min_chars: int = 16
                    ) -> Repetition | None:
    """The loop an unfinished output ends in, if any (no state change).

    Looks first along the value still open at the end of ``text`` for a list whose
    complete items repeat one another (the deepest such list), then for a unit of
    text repeated at least ``min_repeats`` times in a row at the very end, the
    repeats covering at least ``min_chars`` characters.
    """
    value = parse_partial(text)
    path = ""
    found: Repetition | None = None
    while isinstance(value, (dict, list)) and value:
        if isinstance(value, list):
            repeated = _first_repeat(value[:-1])  # the last item may be cut short
            if repeated is not None:
                found = Repetition(repeated=repeated, path=path or "/", kind="item")
        key = list(value)[-1] if isinstance(value, dict) else len(value) - 1
        path += f"/{_escape(str(key))}"
        value = value[key]
    if found is not None:
        return found
    unit = repeating_suffix(text, min_repeats=min_repeats, min_chars=min_chars)
    if unit is None:
        return None
    return Repetition(repeated=unit, path=path, kind="text")


def repeating_suffix(text: str, *, min_repeats: int = 3, min_chars: int = 16) -> str | None:
    """The shortest unit that ``text`` ends with at least ``min_repeats`` times in a row,
    the repeats covering at least ``min_chars`` characters; None if there is none."""
    n = len(text)
    for period in range(1, n // min_repeats + 1):
        i = n - 1 - period
        while i >= 0 and text[i] == text[i + period]:
            i -= 1
        covered = n - 1 - i  # the suffix of this length has the period
        if covered >= max(min_repeats * period, min_chars):
            return text[n - period:]
    return None


def _first_repeat(items: list) -> str | None:
    """The first item (as JSON) equal to an earlier one."""
    seen: set[str] = set()
    for item in items:
        key = json.dumps(item, sort_keys=True, ensure_ascii=False)
        if key in seen:
            return key
        seen.add(key)
    return None


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")
