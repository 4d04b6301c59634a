"""Constraint types: what a caller asks the output to conform to.

Each constraint is an immutable value with a ``kind`` and a ``canonical_text``; the
pair (with the tokenizer's fingerprint) keys the compile cache, so two equal
constraints compile once. Validation here covers only the arguments' shapes; the
content (regex syntax, schema semantics, grammar rules) is checked when compiling.
Either way a problem raises :class:`~formcast.grammars.errors.ConstraintError`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from formcast.grammars.errors import ConstraintError

Whitespace = Literal["compact", "flexible"]

# Whitespace a flexible JSON document may put between two tokens, at most.
DEFAULT_MAX_WHITESPACE = 4
MAX_WHITESPACE_LIMIT = 64


@dataclass(frozen=True)
class Constraint:
    """Base of every constraint type (not instantiated directly)."""

    @property
    def kind(self) -> str:
        raise NotImplementedError

    @property
    def canonical_text(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class Regex(Constraint):
    """The whole output must match ``pattern`` (Python ``re.fullmatch`` semantics).

    Parameters
    ----------
    pattern : str
        A Python regular expression. Lookarounds, backreferences, word boundaries,
        possessive/atomic groups and inline flags other than ``(?x)``/``(?a)`` are
        rejected with a :class:`~formcast.ConstraintError` when compiling.
    """

    pattern: str

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str):
            raise ConstraintError("Regex pattern must be a str, "
                                  f"got {type(self.pattern).__name__}")

    @property
    def kind(self) -> str:
        return "regex"

    @property
    def canonical_text(self) -> str:
        return self.pattern


@dataclass(frozen=True)
class JsonSchema(Constraint):
    """The output must be one JSON document valid against ``schema``.

    Parameters
    ----------
    schema : dict or str
        A JSON Schema (draft 2020-12) as a dict or as JSON text.
    whitespace : {"compact", "flexible"}
        ``"compact"`` (default) allows no whitespace outside strings: ``{"a":1}``.
        ``"flexible"`` allows up to ``max_whitespace`` whitespace characters between
        tokens, so a model cannot loop forever inside whitespace.
    max_whitespace : int or None
        Bound for flexible mode (default 4, at most 64); only valid with
        ``whitespace="flexible"``.
    strict : bool
        ``True`` (default): generation keeps objects closed: an object schema that
        lists ``properties`` but has no ``additionalProperties`` generates only the
        listed properties. This narrows the spec (valid documents with extra keys are
        not generated) on purpose: a model asked for an object should not invent
        keys. ``False``: the spec's default, unlisted properties are allowed.
    """

    schema: Mapping[str, Any] | bool | str
    whitespace: Whitespace = field(default="compact", kw_only=True)
    max_whitespace: int | None = field(default=None, kw_only=True)
    strict: bool = field(default=True, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.schema, (Mapping, str, bool)):
            raise ConstraintError("JsonSchema schema must be a dict, a bool or JSON text, "
                                  f"got {type(self.schema).__name__}")
        if self.whitespace not in ("compact", "flexible"):
            raise ConstraintError("whitespace must be 'compact' or 'flexible', "
                                  f"got {self.whitespace!r}")
        if self.max_whitespace is not None:
            if self.whitespace != "flexible":
                raise ConstraintError("max_whitespace only applies to whitespace='flexible'")
            if (not isinstance(self.max_whitespace, int) or isinstance(self.max_whitespace, bool)
                    or not 1 <= self.max_whitespace <= MAX_WHITESPACE_LIMIT):
                raise ConstraintError("max_whitespace must be an int in "
                                      f"1..{MAX_WHITESPACE_LIMIT}, got {self.max_whitespace!r}")

    @property
    def whitespace_bound(self) -> int:
        """Whitespace characters allowed between two tokens (0 in compact mode)."""
        if self.whitespace == "compact":
            return 0
        return self.max_whitespace if self.max_whitespace is not None else DEFAULT_MAX_WHITESPACE

    @property
    def kind(self) -> str:
        return "json_schema"

    @property
    def schema_text(self) -> str:
        """The schema as JSON text, key order preserved (it decides property order)."""
        if isinstance(self.schema, str):
            return self.schema
        try:
            return json.dumps(self.schema, ensure_ascii=False, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise ConstraintError(f"schema is not JSON-serialisable: {exc}") from exc
        except RecursionError:
            raise ConstraintError("#: the schema is nested too deeply to serialise") from None

    @property
    def canonical_text(self) -> str:
        strict = "" if self.strict else "open;"
        return f"ws={self.whitespace_bound};{strict}{self.schema_text}"


@dataclass(frozen=True)
class Ebnf(Constraint):
    """The output must derive from rule ``root`` of a GBNF/EBNF grammar (xgrammar's dialect).

    Parameters
    ----------
    text : str
        Rules of the form ``name ::= expression``.
    root : str
        The start rule's name (default ``"root"``).
    """

    text: str
    root: str = field(default="root", kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.text, str) or not isinstance(self.root, str) or not self.root:
            raise ConstraintError("Ebnf needs grammar text (str) and a non-empty root rule name")

    @property
    def kind(self) -> str:
        return "ebnf"

    @property
    def canonical_text(self) -> str:
        return f"root={self.root};{self.text}"


@dataclass(frozen=True)
class Lark(Constraint):
    """The output must derive from rule ``start`` of a Lark grammar.

    Parameters
    ----------
    text : str
        A Lark grammar (the subset xgrammar reads: rules, terminals, regular
        expressions, repetition, ``%ignore``, ``%import common``).
    """

    text: str

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise ConstraintError(f"Lark text must be a str, got {type(self.text).__name__}")

    @property
    def kind(self) -> str:
        return "lark"

    @property
    def canonical_text(self) -> str:
        return self.text


@dataclass(frozen=True)
class Choice(Constraint):
    """The output must be exactly one of ``options`` (verbatim text, no quoting).

    Parameters
    ----------
    options : sequence of str
        Distinct, non-empty strings; at least one.
    """

    options: tuple[str, ...]

    def __init__(self, options: Sequence[str]) -> None:
        if isinstance(options, str) or not isinstance(options, Sequence):
            raise ConstraintError("Choice options must be a sequence of strings, "
                                  f"got {type(options).__name__}")
        opts = tuple(options)
        if not opts:
            raise ConstraintError("Choice needs at least one option")
        for i, o in enumerate(opts):
            if not isinstance(o, str) or not o:
                raise ConstraintError(f"Choice option {i} must be a non-empty str, got {o!r}")
        seen: set[str] = set()
        for i, o in enumerate(opts):
            if o in seen:
                raise ConstraintError(f"Choice option {i} ({o!r}) repeats an earlier option; "
                                      "options must be distinct")
            seen.add(o)
        object.__setattr__(self, "options", opts)

    @property
    def kind(self) -> str:
        return "choice"

    @property
    def canonical_text(self) -> str:
        return json.dumps(list(self.options), ensure_ascii=False)
