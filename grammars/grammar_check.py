"""Which rules of a grammar derive a finite string (productivity), before compiling.

A grammar whose start rule derives no finite string (``root ::= root``, a cycle of
rules without a base case, a character class that matches nothing) has an empty
language: a matcher for it allows no end, and a model would write until
``max_tokens``. :func:`check_grammar` finds such grammars before any token is
generated and names the rules at fault.

The rules are read from xgrammar's parse of the source (EBNF, Lark and regex alike
become its rule/expression tables, see ``Grammar.serialize_json``), so the check sees
the grammar exactly as the backend will. Productivity is a least fixpoint: a rule is
productive once its body is; a sequence is productive iff all its parts are, a
choice iff any is, a repetition iff it may repeat zero times or its body is
productive. An expression this module does not know is taken as productive, so the
check never refuses a grammar it cannot read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from formcast.grammars.backends.base import GrammarSource
from formcast.grammars.errors import ConstraintError

# Layout versions of xgrammar's serialized grammar this module reads.
_KNOWN_LAYOUTS = frozenset({"v18"})
_MAX_CODEPOINT = 0x10FFFF

# Expression type tags of xgrammar's grammar tables (its GrammarExprType).
_BYTE_STRING, _CHAR_CLASS, _CHAR_CLASS_STAR, _EMPTY, _RULE_REF = 0, 1, 2, 3, 4
_SEQUENCE, _CHOICES, _REPEAT = 5, 6, 8

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class _Tables:
    """A parsed grammar: rule names, each rule's body expression, the expressions."""

    names: tuple[str, ...]
    bodies: tuple[int, ...]
    exprs: tuple[tuple[int, tuple[int, ...]], ...]    # (type tag, payload)
    root: int


def check_grammar(source: GrammarSource) -> tuple[str, ...]:
    """Refuse a grammar or regex whose language is empty; report rules that are dead.

    Does not change state.

    Parameters
    ----------
    source : GrammarSource
        A regex, EBNF or Lark source (a JSON Schema source is not checked here).

    Returns
    -------
    tuple of str
        Warnings: rules reachable from the start that derive no finite string while
        the start rule still does (the alternatives that use them can never be taken).

    Raises
    ------
    ConstraintError
        The start rule derives no finite string; the message names the rules at fault.
    """
    tables = _parse(source)
    if tables is None:
        return ()
    try:
        productive = _productive(tables)
    except RecursionError:    # xgrammar flattens nesting, so only a pathological table
        return ()
    if not productive[tables.root]:
        # the rules at fault: those the start rule reaches through rules that never finish
        names = _user_names(tables, sorted(_reachable(tables, productive)), source)
        if source.kind == "regex":
            raise ConstraintError(f"regex {source.text!r} matches no string "
                                  "(a part every match needs matches nothing)")
        raise ConstraintError(
            f"{source.kind} grammar derives no finite string: {_rules(names)} "
            "(every alternative needs a rule that never finishes: recursion with "
            "no base case, or a character class that matches nothing)")
    dead = [r for r in sorted(_reachable(tables)) if not productive[r]]
    return tuple(f"{source.kind} grammar: rule {n!r} derives no finite string; the "
                 "alternatives that use it can never be taken"
                 for n in _user_names(tables, dead, source))


def _parse(source: GrammarSource) -> _Tables | None:
    """xgrammar's tables for the source, or None where it does not parse (the backend
    then reports the syntax error) or its layout is one this module does not read."""
    import xgrammar as xgr

    try:
        if source.kind == "ebnf":
            grammar = xgr.Grammar.from_ebnf(source.text, root_rule_name=source.root)
        elif source.kind == "lark":
            grammar = xgr.Grammar.from_lark(source.text)
        elif source.kind == "regex":
            grammar = xgr.Grammar.from_regex(source.text)
        else:
            return None
    except RuntimeError:
        return None
    data = json.loads(grammar.serialize_json())
    if data.get("__VERSION__") not in _KNOWN_LAYOUTS:
        return None
    flat, starts = data["grammar_expr_data"], data["grammar_expr_indptr"]
    # each expression is [type tag, payload length, payload...], starting at its offset
    exprs = tuple((flat[a], tuple(flat[a + 2:a + 2 + flat[a + 1]])) for a in starts)
    return _Tables(names=tuple(r[0] for r in data["rules"]),
                   bodies=tuple(r[1] for r in data["rules"]), exprs=exprs,
                   root=data["root_rule_id"])


def _productive(tables: _Tables) -> list[bool]:
    """Least fixpoint of 'derives a finite string', per rule.

    A worklist: a rule is looked at again only when a rule it refers to has just
    become productive, so each rule is evaluated about once per reference."""
    productive = [False] * len(tables.names)
    users: list[set[int]] = [set() for _ in tables.names]     # rule -> rules that refer to it
    for rule, body in enumerate(tables.bodies):
        for used in _refs(tables, body):
            users[used].add(rule)
    pending = list(range(len(tables.names)))
    while pending:
        rule = pending.pop()
        if not productive[rule] and _expr_productive(tables, tables.bodies[rule], productive):
            productive[rule] = True
            pending.extend(users[rule])
    return productive


def _expr_productive(tables: _Tables, expr: int, productive: Sequence[bool]) -> bool:
    tag, payload = tables.exprs[expr]
    if tag == _CHAR_CLASS:
        return not _class_is_empty(payload)
    if tag == _RULE_REF:
        return productive[payload[0]]
    if tag == _SEQUENCE:
        return all(_expr_productive(tables, e, productive) for e in payload)
    if tag == _CHOICES:
        return any(_expr_productive(tables, e, productive) for e in payload)
    if tag == _REPEAT:
        rule, least = payload[0], payload[1]
        return least == 0 or productive[rule]
    return True   # strings, starred classes, the empty string, and what is not known


def _class_is_empty(payload: tuple[int, ...]) -> bool:
    """Whether a character class [negated, lo0, hi0, lo1, hi1, ...] matches nothing."""
    negated, ranges = payload[0], sorted(zip(payload[1::2], payload[2::2]))
    if not negated:
        return all(lo > hi for lo, hi in ranges)
    covered = 0          # every code point below this is in a range
    for lo, hi in ranges:
        if lo > covered:
            return False
        covered = max(covered, hi + 1)
    return covered > _MAX_CODEPOINT


def _reachable(tables: _Tables, productive: Sequence[bool] | None = None) -> set[int]:
    """Rules the start rule refers to, directly or not (itself included); given
    ``productive``, only through rules that are not."""
    seen = {tables.root}
    stack = [tables.root]
    while stack:
        for rule in _refs(tables, tables.bodies[stack.pop()]):
            if productive is not None and productive[rule]:
                continue
            if rule not in seen:
                seen.add(rule)
                stack.append(rule)
    return seen


def _refs(tables: _Tables, expr: int) -> list[int]:
    tag, payload = tables.exprs[expr]
    if tag in (_RULE_REF, _REPEAT):
        return [payload[0]]
    if tag in (_SEQUENCE, _CHOICES):
        return [r for e in payload for r in _refs(tables, e)]
    return []   # a tag dispatch's rules are not followed: it counts as productive


def _user_names(tables: _Tables, rules: list[int], source: GrammarSource) -> list[str]:
    """The rules' names as the user wrote them: rules xgrammar made up while
    normalising (``root_1``) are left out where a rule of the source's text is at
    fault too, and the start rule (``root`` to xgrammar) has its own name (``start``
    in Lark)."""
    written = set(_NAME.findall(source.text))
    named = []
    for rule in rules:
        name = tables.names[rule]
        if rule == tables.root:
            name = "start" if source.kind == "lark" else source.root
        named.append(name)
    own = [n for n in named if n in written]
    return own or named


def _rules(names: list[str]) -> str:
    quoted = ", ".join(repr(n) for n in names)
    return f"rule {quoted} never finishes" if len(names) == 1 else f"rules {quoted} never finish"
