"""What grounded strings are spans of: the text escaped, its word edges and its breaks.

:func:`source_tables` gives the text as a JSON string body with its boundaries
(:func:`escape_text`), and its :func:`capitalised` copy. Its *breaks* are where a
grounded string may not run on: the text's clause and list separators.

A small model left to copy a span of the text runs past the value it meant: a
title swallows the rest of the sentence ("Join the city marathon in Boston on
2026-04-20; registration is "), a date keeps its comma, and a list item takes the
whole enumeration ("Go, PostgreSQL, Kafka"). With ``GroundingPlan(clauses=True)``
no grounded string crosses a *clause break* of the text:

- ``,`` ``;`` followed by a space or the end (not ``37,980``), line breaks and tabs,
  brackets ``( ) [ ]``, ``|``, bullets and a dash between spaces (``Salad - 4 servings``);
- a sentence end: ``.`` ``!`` ``?`` followed by a space or the end, unless the ``.``
  ends an initial or a title ("David L. Lawrence", "Dr. Reyes", "J.R.R. Tolkien"; a
  digit is no initial: "Serves: 8. Time" ends a sentence).

A list item (a string whose container is an array) also ends at an *item break*:
the words ``and``, ``or`` and ``&`` between spaces ("C and C++" gives "C", "C++").

:func:`clause_breaks` finds them; the grounding tables blank them out
(:func:`source_tables`), so a value ends before one.
"""

from __future__ import annotations

import json
import re

# (a "." that ends one of these words is an abbreviation, not a sentence end)
_TITLES = frozenset({"mr", "mrs", "ms", "dr", "prof", "st", "jr", "sr", "mt", "no", "vs",
                     "etc", "inc", "ltd", "co", "corp", "dept", "approx", "e.g", "i.e"})
_CLAUSE = re.compile(r"[,;](?=\s|$)|[\n\r\t()\[\]|•·]|[!?](?=\s|$)|(?<=\s)[-–—](?=\s)")
_SENTENCE_DOT = re.compile(r"(\S*)\.(?=\s|$)")
_WORD_START = re.compile(r"(?<!\S)\w")
START, STOP = 1, 2  # a boundary's bits: a grounded value may start there, may end there
_ITEM = re.compile(r"(?<=\s)(?:and|or|&)(?=\s)", re.IGNORECASE)


def clause_breaks(text: str, *, items: bool = False) -> frozenset[int]:
    """The offsets of the characters of ``text`` that no grounded string may hold.

    Parameters
    ----------
    text : str
    items : bool
        Also the list-item breaks (``and``, ``or``, ``&`` between spaces).

    Returns
    -------
    frozenset of int
        Character offsets into ``text`` (see the module docstring).
    """
    found = {m.start() for m in _CLAUSE.finditer(text)}
    for m in _SENTENCE_DOT.finditer(text):
        word = m.group(1).lstrip("\"'(").casefold()
        # (an initial: one letter, or letters joined by dots as in "J.R.R")
        if re.fullmatch(r"(?:[^\W\d_]\.)*[^\W\d_]", word) and len(word.replace(".", "")) <= 1:
            continue
        if word in _TITLES or re.fullmatch(r"(?:[^\W\d_]\.)+[^\W\d_]", word):
            continue
        found.add(m.end() - 1)
    if items:
        for m in _ITEM.finditer(text):
            found.update(range(m.start(), m.end()))
    return frozenset(found)


def _in_word(ch: str) -> bool:
    """Whether ``ch`` belongs to a word (letters and digits of scripts written with
    spaces: ideographs and kana are words of one character each)."""
    return ch.isalnum() and ch < "\u2e80"


def escape_text(text: str, *, words: bool = False, breaks: frozenset[int] = frozenset()
                ) -> tuple[bytes, bytes]:
    """``text`` as a JSON string body (UTF-8) and its boundaries: per offset of the body
    (and its end), :data:`START` if a value may start there and :data:`STOP` if one may
    end there. Values start and end where a character or escape starts, and at the
    end; with ``words``, only where that is not inside a word (between two letters or
    digits), and never next to whitespace inside the value (no " Lots" or "Lots ":
    a value that stops at a space stops mid-phrase). The characters at offsets
    ``breaks`` are NUL bytes, which no JSON string body holds: no span crosses them."""
    body = bytearray(json.dumps(text, ensure_ascii=False)[1:-1].encode("utf-8",
                                                                         "surrogatepass"))
    marks = bytearray(len(body) + 1)
    widths: dict[str, int] = {}
    pos = 0
    before = False                  # whether the character before is in a word
    spaced = False                  # whether it is whitespace (in words mode)
    for k, ch in enumerate(text):
        width = widths.get(ch)
        if width is None:
            width = widths[ch] = len(json.dumps(ch, ensure_ascii=False)[1:-1].encode(
                "utf-8", "surrogatepass"))
        inside = words and _in_word(ch)
        space = words and ch.isspace()
        if not (before and inside):
            marks[pos] = (0 if space else START) | (0 if spaced else STOP)
        if k in breaks:
            body[pos:pos + width] = bytes(width)
        before, spaced = inside, space
        pos += width
    marks[pos] = START | (0 if spaced else STOP)
    return bytes(body), bytes(marks)


def capitalised(text: str) -> str:
    """``text`` with the first letter of each word (after whitespace) upper-cased."""
    return _WORD_START.sub(lambda m: m.group(0).upper(), text)


def source_tables(text: str, *, words: bool = False, capitalise: bool = False,
                  breaks: frozenset[int] = frozenset()) -> tuple[bytes, bytes]:
    """What grounded strings are spans of, escaped, with its boundaries
    (:func:`escape_text`, ``breaks`` blanked); with ``capitalise``, the text then (if it
    differs) its :func:`capitalised` copy, joined by a NUL byte that no JSON string
    body holds, so no span crosses from one to the other."""
    body, marks = escape_text(text, words=words, breaks=breaks)
    titled = capitalised(text) if capitalise else text
    if titled == text:
        return body, marks
    body2, marks2 = escape_text(titled, words=words, breaks=breaks)
    return body + b"\x00" + body2, marks + marks2
