"""Python regular expressions -> one portable regex both mask backends read alike.

A :class:`~formcast.grammars.Regex` means what ``re.fullmatch`` means, since that is
what a Python caller (and our test oracle) expects. The backends each read their own
dialect (xgrammar: ECMA-like, ``.`` matches a newline and ``\\d`` is ASCII;
outlines-core: Rust ``regex``), so the pattern is parsed with Python's own parser and
re-emitted with every character class spelled out as explicit code point ranges:
the language the backends see is then the language ``re.fullmatch`` accepts, except
that ``\\d``, ``\\w`` and ``\\s`` in a positive class keep only their ASCII members (a
subset, so every output still matches; their negations stay exact).

Constructs that do not describe a regular language token masks can follow
(lookarounds, backreferences, word boundaries, anchors away from the ends,
possessive/atomic groups, case-insensitive or dot-all flags) are refused with a
:class:`~formcast.ConstraintError` naming the construct.
"""

from __future__ import annotations

import re
import re._constants as sre_c
import re._parser as sre_parse
from dataclasses import dataclass
from functools import lru_cache

from formcast.grammars.errors import ConstraintError

_MAX_CODE_POINT = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)
# Flags that do not change the language of a str pattern (VERBOSE is parse-time only).
_HARMLESS_FLAGS = sre_c.SRE_FLAG_UNICODE | sre_c.SRE_FLAG_VERBOSE
_FLAG_NAMES = {sre_c.SRE_FLAG_IGNORECASE: "(?i) case-insensitive matching",
               sre_c.SRE_FLAG_DOTALL: "(?s) dot-all", sre_c.SRE_FLAG_MULTILINE: "(?m) multi-line",
               sre_c.SRE_FLAG_LOCALE: "(?L) locale"}
_CATEGORY_PATTERNS = {"DIGIT": r"\d", "WORD": r"\w", "SPACE": r"\s"}
_ASCII_SETS = {"DIGIT": "0123456789",
               "WORD": "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_",
               "SPACE": " \t\n\r\f\v"}
_META = set(".^$|?*+()[]{}\\/-\"")
_CLASS_META = set("\\]-[^")

Ranges = list[tuple[int, int]]
_BEGIN = (sre_c.AT_BEGINNING, sre_c.AT_BEGINNING_STRING)
_END = (sre_c.AT_END, sre_c.AT_END_STRING)


def translate(pattern: str, *, where: str = "regex", search: bool = False,
              json_string: bool = False) -> str:
    """Re-emit a Python regex as a portable one with the same ``fullmatch`` language.

    Does not change state. Anchors at the very start/end are dropped (full matching
    makes them redundant).

    Parameters
    ----------
    pattern : str
        The Python regular expression.
    where : str
        How errors name the pattern's origin (e.g. a JSON pointer).
    search : bool
        Emit the language of ``re.search`` instead (JSON Schema's ``pattern``): any
        text may come before a match not anchored at the start, and after one not
        anchored at the end.
    json_string : bool
        The regex will match the content of a JSON string: classes leave out the
        control characters (the backend would let them through raw, which is not
        JSON; their escaped spellings are given up too, a narrowing).

    Returns
    -------
    str
        A regex readable by xgrammar and by outlines-core.

    Raises
    ------
    ConstraintError
        Invalid syntax (with the position) or a construct masks cannot follow.
    """
    try:
        parsed = sre_parse.parse(pattern)
    except re.error as exc:
        raise ConstraintError(f"invalid {where} {pattern!r}: {exc.msg} at position {exc.pos}"
                              ) from None
    return _emit(parsed, pattern, where, search=search, json_string=json_string, relax=False)


def _emit(parsed, pattern: str, where: str, *, search: bool, json_string: bool,
          relax: bool) -> tuple[str, set[str]] | str:
    flags = parsed.state.flags
    ascii_only = bool(flags & sre_c.SRE_FLAG_ASCII)
    _check_flags(flags & ~sre_c.SRE_FLAG_ASCII, pattern, where)
    emitter = _Emitter(pattern, where, ascii_only, search, json_string, relax)
    if relax:
        emitter.groups = dict(_groups(list(parsed)))
    out = emitter.sequence(list(parsed), at_start=True, at_end=True)
    if out is None:
        raise ConstraintError(f"{where} {pattern!r} matches no string a token mask can write "
                              "(a character class in it matches no character)")
    return (out, emitter.relaxed) if relax else out


@dataclass(frozen=True)
class SchemaPattern:
    """How the mask follows one JSON Schema ``pattern``: the regex it compiles, and
    whether that regex is the pattern's language (else a wider one, the end check
    deciding)."""

    regex: str
    exact: bool
    note: str


def schema_pattern(pattern: str, *, where: str = "pattern") -> SchemaPattern:
    """The mask's regex for a JSON Schema ``pattern`` (``re.search``, inside a JSON string).

    Does not change state. A pattern whose constructs a mask cannot follow
    (lookarounds, backreferences, word boundaries, inline flags) is widened: the
    regex drops the assertions and repeats a referenced group's pattern, or, where
    that is not possible, allows any string; ``exact`` is then False and the caller
    must check the pattern on the finished value.

    Raises
    ------
    ConstraintError
        A pattern Python's ``re`` cannot read (nothing could check it).
    """
    try:
        return _schema_pattern(pattern)
    except ConstraintError as exc:
        raise ConstraintError(str(exc).replace("invalid pattern", f"invalid {where}")) from None


@lru_cache(maxsize=512)
def _schema_pattern(pattern: str) -> SchemaPattern:
    try:
        parsed = sre_parse.parse(pattern)
    except re.error as exc:
        raise ConstraintError(f"invalid pattern {pattern!r}: {exc.msg} at position {exc.pos}"
                              ) from None
    try:
        text = _emit(parsed, pattern, "pattern", search=True, json_string=True, relax=False)
        return SchemaPattern(regex=text, exact=True, note="")
    except ConstraintError:
        pass
    try:
        text, relaxed = _emit(parsed, pattern, "pattern", search=True, json_string=True,
                              relax=True)
        return SchemaPattern(regex=text, exact=False, note=(
            f"the mask follows the pattern without its {', '.join(sorted(relaxed))}; the "
            "exact pattern is checked at the end"))
    except (ConstraintError, RecursionError):
        anything = _emit(sre_parse.parse(""), "", "pattern", search=True, json_string=True,
                         relax=False)
        return SchemaPattern(regex=anything, exact=False, note=(
            "the mask allows any string here (the pattern uses what a mask cannot follow); "
            "the pattern is checked at the end"))


def _groups(items: list) -> list[tuple[int, list]]:
    """(group number, its items) for every capturing group in a parsed pattern."""
    found = []
    for op, av in items:
        if op is sre_c.SUBPATTERN:
            if av[0] is not None:
                found.append((av[0], list(av[3])))
            found += _groups(list(av[3]))
        elif op is sre_c.BRANCH:
            for alt in av[1]:
                found += _groups(list(alt))
        elif op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT, sre_c.POSSESSIVE_REPEAT):
            found += _groups(list(av[2]))
        elif op in (sre_c.ASSERT, sre_c.ASSERT_NOT):
            found += _groups(list(av[1]))
        elif op is sre_c.ATOMIC_GROUP:
            found += _groups(list(av))
        elif op is sre_c.GROUPREF_EXISTS:
            found += _groups(list(av[1])) + (_groups(list(av[2])) if av[2] else [])
    return found


def literal(text: str) -> str:
    """A portable regex matching exactly ``text``. Does not change state."""
    return "".join(_char(ord(c)) for c in text)


def _check_flags(flags: int, pattern: str, where: str) -> None:
    bad = flags & ~_HARMLESS_FLAGS
    if bad:
        names = [n for f, n in _FLAG_NAMES.items() if bad & f] or [f"flags {bad:#x}"]
        raise ConstraintError(f"{where} {pattern!r} uses {', '.join(names)}, which token masks "
                              "do not support; spell the alternatives out instead")


class _Emitter:
    """Emits a parsed pattern; None stands for a part that matches no string."""

    def __init__(self, pattern: str, where: str, ascii_only: bool, search: bool = False,
                 json_string: bool = False, relax: bool = False) -> None:
        self.pattern, self.where, self.ascii_only = pattern, where, ascii_only
        self.search, self.json_string, self.relax = search, json_string, relax
        self.groups: dict[int, list] = {}      # relaxed: what a backreference repeats
        self.relaxed: set[str] = set()         # relaxed: the constructs widened
        self._open: set[int] = set()

    def chars(self, ranges: Ranges) -> str | None:
        """A class of ``ranges`` (less the control characters inside a JSON string)."""
        if self.json_string:
            ranges = merge_ranges([(max(lo, 0x20), hi) for lo, hi in ranges if hi >= 0x20])
        return _class(ranges) if _without_surrogates(ranges) else None

    def fail(self, construct: str) -> ConstraintError:
        return ConstraintError(f"{self.where} {self.pattern!r} uses {construct}, which token "
                               "masks cannot enforce (only regular languages are supported)")

    def sequence(self, items: list, *, at_start: bool, at_end: bool) -> str | None:
        out = []
        last = len(items) - 1
        for i, (op, av) in enumerate(items):
            leading = at_start and all(o is sre_c.AT for o, _ in items[:i])
            trailing = at_end and all(o is sre_c.AT for o, _ in items[i + 1:])
            part = self.node(op, av, at_start=leading, at_end=trailing and i <= last)
            if part is None:
                return None
            out.append(part)
        if self.search:
            # re.search: free text before/after unless an anchor (or a group that
            # handles its own ends) sits there.
            text = "(" + self.chars([(0, _MAX_CODE_POINT)]) + ")*"
            if at_start and not self._anchored(items, _BEGIN):
                out.insert(0, text)
            if at_end and not self._anchored(items[::-1], _END):
                out.append(text)
        return "".join(out)

    @staticmethod
    def _anchored(items: list, anchors: tuple) -> bool:
        for op, av in items:
            if op is sre_c.AT:
                if av in anchors:
                    return True
                continue
            return op in (sre_c.BRANCH, sre_c.SUBPATTERN)
        return False

    def node(self, op, av, *, at_start: bool, at_end: bool) -> str | None:
        if op is sre_c.LITERAL:
            return None if self.json_string and av < 0x20 else _char(av)
        if op is sre_c.NOT_LITERAL:
            return self.chars(_complement([(av, av)]))
        if op is sre_c.ANY:
            return self.chars(_complement([(0x0A, 0x0A)]))
        if op is sre_c.IN:
            return self.chars(self.char_set(av))
        if op is sre_c.BRANCH:
            alts = [self.sequence(list(p), at_start=at_start, at_end=at_end) for p in av[1]]
            kept = [a for a in alts if a is not None]
            return "(" + "|".join(kept) + ")" if kept else None
        if op is sre_c.SUBPATTERN:
            group, add_flags, del_flags, sub = av
            _check_flags(add_flags | del_flags, self.pattern, self.where)
            self._open.add(group)
            body = self.sequence(list(sub), at_start=at_start, at_end=at_end)
            self._open.discard(group)
            return None if body is None else "(" + body + ")"
        if op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT) or (
                self.relax and op is sre_c.POSSESSIVE_REPEAT):
            lo, hi, sub = av
            body = self.sequence(list(sub), at_start=False, at_end=False)
            if body is None:
                return "" if lo == 0 else None
            return "(" + body + ")" + _quantifier(lo, hi)
        if op is sre_c.AT:
            if av in (sre_c.AT_BEGINNING, sre_c.AT_BEGINNING_STRING) and at_start:
                return ""
            if av in (sre_c.AT_END, sre_c.AT_END_STRING) and at_end:
                return ""
            names = {sre_c.AT_BOUNDARY: r"a word boundary \b",
                     sre_c.AT_NON_BOUNDARY: r"a non-boundary \B"}
            name = names.get(av, "an anchor away from the ends")
            return self.widened("anchors", "") if self.relax else self._raise(name)
        if self.relax:
            return self.relaxed_node(op, av, at_start=at_start, at_end=at_end)
        names = {sre_c.GROUPREF: "a backreference", sre_c.GROUPREF_EXISTS: "a conditional group",
                 sre_c.ASSERT: "a lookahead/lookbehind", sre_c.ASSERT_NOT: "a negative lookaround",
                 sre_c.ATOMIC_GROUP: "an atomic group",
                 sre_c.POSSESSIVE_REPEAT: "a possessive quantifier"}
        raise self.fail(names.get(op, str(op)))

    def _raise(self, name: str) -> str:
        raise self.fail(name)

    def widened(self, construct: str, text: str | None) -> str | None:
        self.relaxed.add(construct)
        return text

    def relaxed_node(self, op, av, *, at_start: bool, at_end: bool) -> str | None:
        """A wider stand-in for a construct a mask cannot follow (the end check decides)."""
        if op in (sre_c.ASSERT, sre_c.ASSERT_NOT):
            return self.widened("lookarounds", "")
        if op is sre_c.ATOMIC_GROUP:
            body = self.sequence(list(av), at_start=at_start, at_end=at_end)
            return self.widened("atomic groups", None if body is None else "(" + body + ")")
        if op is sre_c.GROUPREF:
            if av in self._open or av not in self.groups:
                raise self.fail("a backreference inside its own group")
            self._open.add(av)
            body = self.sequence(self.groups[av], at_start=False, at_end=False)
            self._open.discard(av)
            return self.widened("backreferences", None if body is None else "(" + body + ")")
        if op is sre_c.GROUPREF_EXISTS:
            _group, yes, no = av
            alts = [self.sequence(list(p), at_start=at_start, at_end=at_end)
                    for p in (yes, no or [])]
            kept = [a for a in alts if a is not None]
            return self.widened("conditional groups",
                                "(" + "|".join(kept) + ")" if kept else None)
        raise self.fail(str(op))

    def char_set(self, items: list) -> Ranges:
        negated = any(op is sre_c.NEGATE for op, _ in items)
        negate = False
        ranges: Ranges = []
        for op, av in items:
            if op is sre_c.NEGATE:
                negate = True
            elif op is sre_c.LITERAL:
                ranges.append((av, av))
            elif op is sre_c.RANGE:
                ranges.append(av)
            elif op is sre_c.CATEGORY:
                name = str(av).removeprefix("CATEGORY_")
                positive = name.removeprefix("NOT_")
                if positive not in _CATEGORY_PATTERNS:
                    raise self.fail(f"the character category {name}")
                if name.startswith("NOT_"):
                    ranges.extend(_complement(_category(positive, self.ascii_only)))
                else:
                    # Narrowing a positive class to the ASCII members keeps the language
                    # a subset of Python's; inside a negated class it would widen it.
                    ranges.extend(_category(positive, self.ascii_only or not negated))
            else:
                raise self.fail(f"the class item {op}")
        merged = merge_ranges(ranges)
        return _complement(merged) if negate else merged


def _quantifier(lo: int, hi: int) -> str:
    if hi is sre_c.MAXREPEAT or hi == sre_c.MAXREPEAT:
        return {0: "*", 1: "+"}.get(lo, f"{{{lo},}}")
    if (lo, hi) == (0, 1):
        return "?"
    return f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}"


def _escape(cp: int, meta: set[str]) -> str:
    ch = chr(cp)
    if ch in meta:
        return "\\" + ch
    if ch == "\n":
        return r"\n"
    if ch == "\t":
        return r"\t"
    if ch == "\r":
        return r"\r"
    if cp < 0x20 or cp == 0x7F:
        return f"\\x{cp:02x}"
    if cp < 0x7F:
        return ch
    # Astral characters go in literally: xgrammar's JSON-pattern reader has no \U escape.
    return f"\\u{cp:04x}" if cp <= 0xFFFF else ch


def _char(cp: int) -> str:
    return _escape(cp, _META)


def _class(ranges: Ranges) -> str:
    ranges = _without_surrogates(ranges)
    if not ranges:
        raise ConstraintError("a character class in the pattern matches no character")
    parts = []
    for lo, hi in ranges:
        if lo == hi:
            parts.append(_escape(lo, _CLASS_META))
        else:
            parts.append(_escape(lo, _CLASS_META) + "-" + _escape(hi, _CLASS_META))
    return "[" + "".join(parts) + "]"


def merge_ranges(ranges: Ranges) -> Ranges:
    """``ranges`` of code points sorted, with touching and overlapping ones joined."""
    out: Ranges = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def complement_ranges(ranges: Ranges) -> Ranges:
    """The code points (surrogates included) that ``ranges`` leave out, as ranges."""
    out: Ranges = []
    nxt = 0
    for lo, hi in merge_ranges(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= _MAX_CODE_POINT:
        out.append((nxt, _MAX_CODE_POINT))
    return out


def _complement(ranges: Ranges) -> Ranges:
    return _without_surrogates(complement_ranges(ranges))


def _without_surrogates(ranges: Ranges) -> Ranges:
    lo_s, hi_s = _SURROGATES
    out: Ranges = []
    for lo, hi in ranges:
        if hi < lo_s or lo > hi_s:
            out.append((lo, hi))
            continue
        if lo < lo_s:
            out.append((lo, lo_s - 1))
        if hi > hi_s:
            out.append((hi_s + 1, hi))
    return out


@lru_cache(maxsize=8)
def _category(name: str, ascii_only: bool) -> Ranges:
    """The exact code points Python's ``\\d``/``\\w``/``\\s`` match, as ranges."""
    if ascii_only:
        return merge_ranges([(ord(c), ord(c)) for c in _ASCII_SETS[name]])
    everything = "".join(chr(c) for c in range(_MAX_CODE_POINT + 1)
                         if not _SURROGATES[0] <= c <= _SURROGATES[1])
    hits = sorted(ord(c) for c in re.findall(_CATEGORY_PATTERNS[name], everything))
    return merge_ranges([(c, c) for c in hits])

