"""JSON Schema patterns written for ECMA-262 engines, read as Python regular expressions.

JSON Schema's ``pattern`` and ``patternProperties`` are ECMA-262 regexes; formcast,
its end check and ``jsonschema`` read them with Python's ``re``. The two dialects
agree on most patterns real schemas use, but not on a few ECMA-262 (and Java)
spellings that Python refuses outright: Unicode property classes (``\\p{L}``,
``\\P{Cc}``, ``\\p{Graph}``), surrogate pairs spelt as two ``\\uXXXX`` escapes,
``\\u{...}`` code points, ``\\cX`` control escapes, ``(?<name>...)`` groups and
``[^]``. :func:`python_pattern` rewrites those into the Python spelling of the same
characters, so that the metaschema check, the mask and the end check all read the
pattern; :func:`with_python_patterns` applies it throughout a schema. A pattern
Python already reads is left alone (its meaning is Python's, as jsonschema's).
"""

from __future__ import annotations

import re
import sys
import unicodedata
import warnings
from functools import lru_cache
from typing import Any

from formcast.grammars.regex_dialect import complement_ranges, merge_ranges

Ranges = list[tuple[int, int]]

_MAX = sys.maxunicode
# Java's POSIX classes (US-ASCII, as Java reads them by default).
_POSIX = {
    "lower": [(0x61, 0x7A)], "upper": [(0x41, 0x5A)], "ascii": [(0x00, 0x7F)],
    "alpha": [(0x41, 0x5A), (0x61, 0x7A)], "digit": [(0x30, 0x39)],
    "alnum": [(0x30, 0x39), (0x41, 0x5A), (0x61, 0x7A)],
    "punct": [(0x21, 0x2F), (0x3A, 0x40), (0x5B, 0x60), (0x7B, 0x7E)],
    "graph": [(0x21, 0x7E)], "print": [(0x20, 0x7E)], "blank": [(0x09, 0x09), (0x20, 0x20)],
    "cntrl": [(0x00, 0x1F), (0x7F, 0x7F)], "xdigit": [(0x30, 0x39), (0x41, 0x46), (0x61, 0x66)],
    "space": [(0x09, 0x0D), (0x20, 0x20)],
}
# Unicode's long names of the general categories (and of their groups).
_LONG = {
    "letter": "L", "cased_letter": "LC", "uppercase_letter": "Lu", "lowercase_letter": "Ll",
    "titlecase_letter": "Lt", "modifier_letter": "Lm", "other_letter": "Lo", "mark": "M",
    "combining_mark": "M", "nonspacing_mark": "Mn", "spacing_mark": "Mc",
    "enclosing_mark": "Me", "number": "N", "decimal_number": "Nd",
    "letter_number": "Nl", "other_number": "No", "punctuation": "P",
    "connector_punctuation": "Pc", "dash_punctuation": "Pd", "open_punctuation": "Ps",
    "close_punctuation": "Pe", "initial_punctuation": "Pi", "final_punctuation": "Pf",
    "other_punctuation": "Po", "symbol": "S", "math_symbol": "Sm", "currency_symbol": "Sc",
    "modifier_symbol": "Sk", "other_symbol": "So", "separator": "Z", "space_separator": "Zs",
    "line_separator": "Zl", "paragraph_separator": "Zp", "other": "C", "control": "Cc",
    "format": "Cf", "surrogate": "Cs", "private_use": "Co", "unassigned": "Cn",
}
_PROPERTY = re.compile(r"\\([pP])\{([^}]*)\}")
_VALUE_KEYWORDS = frozenset({"const", "enum", "default", "examples", "example"})


@lru_cache(maxsize=1)
def _categories() -> dict[str, Ranges]:
    """Every general category (two letters) as code point ranges, in one pass."""
    found: dict[str, Ranges] = {}
    for cp in range(_MAX + 1):
        ranges = found.setdefault(unicodedata.category(chr(cp)), [])
        if ranges and ranges[-1][1] == cp - 1:
            ranges[-1] = (ranges[-1][0], cp)
        else:
            ranges.append((cp, cp))
    return found


@lru_cache(maxsize=64)
def property_ranges(name: str) -> tuple[tuple[int, int], ...] | None:
    """The code points of the Unicode property ``\\p{name}`` (None: a name not known).

    Known: general categories, short (``L``, ``Lu``, ``LC``) or long (``Letter``),
    also as ``gc=``/``General_Category=``; ``Any``, ``ASCII``, ``Assigned``; and
    Java's POSIX classes (``Graph``, ``Alnum``, ``Punct``, ..., also ``IsGraph``).
    """
    key = name.strip()
    if "=" in key:
        prop, _, key = key.partition("=")
        if prop.strip().lower() not in ("gc", "general_category"):
            return None
    low = key.lower().replace(" ", "_").replace("-", "_")
    if low == "any":
        return ((0, _MAX),)
    if low == "assigned":
        return tuple(complement_ranges(list(_categories().get("Cn", []))))
    posix = _POSIX.get(low) or _POSIX.get(low.removeprefix("is"))
    if posix is not None:
        return tuple(posix)
    code = _LONG.get(low, key if key[:1].isupper() else None)
    if code is None:
        return None
    table = _categories()
    if code == "LC" or code == "L&":
        picked = [r for c in ("Lu", "Ll", "Lt") for r in table.get(c, [])]
    elif len(code) == 1:
        picked = [r for c, rs in table.items() if c[0] == code for r in rs]
        if not picked:
            return None
    elif code in table or (len(code) == 2 and code[0] in "LMNPSZC"):
        picked = list(table.get(code, []))
    else:
        return None
    return tuple(merge_ranges(picked))


def _escape(cp: int) -> str:
    if cp <= 0xFF:
        return f"\\x{cp:02x}"
    return f"\\u{cp:04x}" if cp <= 0xFFFF else f"\\U{cp:08x}"


def _class_body(ranges: Ranges) -> str:
    return "".join(_escape(lo) if lo == hi else f"{_escape(lo)}-{_escape(hi)}"
                   for lo, hi in ranges)


def _surrogate_pairs(pattern: str) -> str:
    r"""``\uD83D\uDE00`` (UTF-16 halves) -> the one code point they spell."""
    def join(m: re.Match) -> str:
        high, low = int(m.group(1), 16), int(m.group(2), 16)
        return _escape(0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00))
    return re.sub(r"\\u([dD][89abAB][0-9a-fA-F]{2})\\u([dD][c-fC-F][0-9a-fA-F]{2})", join,
                  pattern)


def _rewrite(pattern: str) -> str | None:
    """The Python spelling of an ECMA-262 pattern, or None where a construct is unknown."""
    text = _surrogate_pairs(pattern)
    out: list[str] = []
    i, in_class = 0, False
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            m = _PROPERTY.match(text, i)
            if m is not None:
                ranges = property_ranges(m.group(2))
                if ranges is None:
                    return None
                ranges = list(ranges) if m.group(1) == "p" else complement_ranges(list(ranges))
                body = _class_body(ranges)
                out.append(body if in_class else f"[{body}]")
                i = m.end()
                continue
            braced = re.compile(r"\\u\{([0-9a-fA-F]{1,6})\}").match(text, i)
            if braced is not None:
                out.append(_escape(int(braced.group(1), 16)))
                i = braced.end()
                continue
            if nxt == "c" and i + 2 < len(text) and text[i + 2].isalpha():
                out.append(_escape(ord(text[i + 2]) % 32))
                i += 3
                continue
            if nxt == "k" and not in_class and text.startswith("<", i + 2):
                end = text.find(">", i)
                out.append(f"(?P={text[i + 3:end]})")
                i = end + 1
                continue
            out.append(text[i:i + 2])
            i += 2
            continue
        if in_class:
            if ch == "]":
                in_class = False
            # literal in an ECMA class; doubled or nested, Python reads set operations
            out.append("\\" + ch if ch in "|&~[" else ch)
            i += 1
            continue
        if ch == "[":
            if text.startswith("[^]", i):
                out.append(r"[\s\S]")
                i += 3
                continue
            if text.startswith("[]", i):
                out.append("(?!)")
                i += 2
                continue
            in_class = True
            out.append(ch)
            # a leading ']' or '^]' would close an ECMA class but not a Python one
            i += 1
            continue
        if text.startswith("(?<", i) and text[i + 3:i + 4] not in ("=", "!"):
            out.append("(?P<")
            i += 3
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def python_pattern(pattern: str) -> str:
    """``pattern`` spelt so Python's ``re`` reads it with its ECMA-262 meaning.

    Does not change state. A pattern ``re`` compiles is returned as it is; one it
    cannot compile even after the rewrite is returned as it is too (the schema's
    metaschema check then names it).

    Parameters
    ----------
    pattern : str
        A JSON Schema (ECMA-262) regular expression.

    Returns
    -------
    str
    """
    if _compiles(pattern):
        return pattern
    rewritten = _rewrite(pattern)
    return rewritten if rewritten is not None and _compiles(rewritten) else pattern


def _compiles(pattern: str) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)   # set-operation hints
        try:
            re.compile(pattern)
        except (re.error, OverflowError, RecursionError):
            return False
    return True


def with_python_patterns(schema: Any) -> Any:
    """``schema`` with every ``pattern`` and ``patternProperties`` key in Python's spelling.

    Does not change ``schema``: the parts that change are copied, the rest is shared.
    Values (``const``, ``enum``, ``default``, ``examples``) are never touched.
    """
    if isinstance(schema, list):
        items = [with_python_patterns(v) for v in schema]
        return items if any(a is not b for a, b in zip(items, schema)) else schema
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    changed = False
    for kw, value in schema.items():
        if kw in _VALUE_KEYWORDS:
            new = value
        elif kw == "pattern" and isinstance(value, str):
            new = python_pattern(value)
        elif kw == "patternProperties" and isinstance(value, dict):
            new = {python_pattern(k): with_python_patterns(v) for k, v in value.items()}
            if list(new) == list(value) and all(a is b for a, b in zip(new.values(),
                                                                        value.values())):
                new = value
        else:
            new = with_python_patterns(value)
        changed |= new is not value
        out[kw] = new
    return out if changed else schema
