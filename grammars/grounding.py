"""Grounded values: strings and numbers the output must take from a source text.

Which values of a JSON document are grounded is a :class:`GroundingPlan`, found from
the JSON Schema by :func:`grounding_plan`; fields opt in or out with the markers
:data:`Grounded` and :data:`NotGrounded` (the schema keyword ``"x-grounded"``).
:func:`ground` wraps a JSON-Schema matcher so that its mask also keeps every
grounded value in the text::

    from typing import Annotated
    from pydantic import BaseModel
    from formcast import grammars

    class Person(BaseModel):
        name: str                                   # grounded ("auto": a plain string)
        age: Annotated[int, grammars.Grounded]      # grounded number
        summary: Annotated[str, grammars.NotGrounded]

    schema = Person.model_json_schema()
    compiled = grammars.compile(grammars.JsonSchema(schema), tokenizer)
    matcher = compiled.grounded_matcher(text, grammars.grounding_plan(schema))
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from formcast.grammars.errors import ConstraintError
from formcast.grammars.schema_refs import lookup

if TYPE_CHECKING:   # the matcher and vocabulary pull in torch; checking a constraint must not
    from formcast.grammars.matcher import Matcher
    from formcast.grammars.vocab import Vocabulary

MODES = ("off", "auto", "strict")
KEYWORD = "x-grounded"
ANY_INDEX = "*"
_NOT_PLAIN = ("enum", "const", "pattern", "format")
_RECURSION = 3          # how deep a recursive $ref is followed (paths are finite)


@dataclass(frozen=True)
class GroundingMarker:
    """Marks a pydantic field grounded or not: ``Annotated[str, Grounded]``.

    It adds ``"x-grounded": true`` (or ``false``) to the field's JSON Schema, which
    :func:`grounding_plan` reads; a JSON Schema dict may carry the keyword itself.
    """

    grounded: bool

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> dict:
        schema = dict(handler(core_schema))
        schema[KEYWORD] = self.grounded
        return schema

    def __repr__(self) -> str:
        return "Grounded" if self.grounded else "NotGrounded"


Grounded = GroundingMarker(True)
"""The field's value must come from the text (a string span, or a number written there)."""
NotGrounded = GroundingMarker(False)
"""The field may say what the text does not (e.g. a summary), whatever the mode."""


class PlanNode:
    """One path of a :class:`GroundingPlan`'s tree: its children by key (``"*"``:
    any array index) and whether a string or number there is grounded (``integer``:
    the number is an integer, so only the text's whole numbers may be it)."""

    __slots__ = ("children", "string", "number", "integer")

    def __init__(self) -> None:
        self.children: dict[str, PlanNode] = {}
        self.string = False
        self.number = False
        self.integer = False

    def at(self, path: tuple[str, ...]) -> PlanNode:
        node = self
        for step in path:
            node = node.children.setdefault(step, PlanNode())
        return node


@dataclass(frozen=True)
class GroundingPlan:
    """Which values of a JSON document are grounded, as path patterns.

    A path is a tuple of object keys and ``"*"`` (any array index); ``()`` is the
    document itself. Hashable; false when nothing is grounded.

    Attributes
    ----------
    strings : frozenset of tuple of str
        Paths whose string values are grounded.
    numbers : frozenset of tuple of str
        Paths whose number values are grounded.
    integers : frozenset of tuple of str
        The paths of ``numbers`` whose schema allows integers only.
    words : bool
        A grounded string starts and ends at word edges only (never between two
        letters or digits of the text): "Plu" is no value of "plumber".
    capitalise : bool
        A grounded string may also be a span of the text with each word's first
        letter upper-cased ("Nurse" from "a nurse").
    clauses : bool
        A grounded string crosses no clause break of the text (", ", "; ", a line
        break, a sentence end), and a list item (a string in an array) no "and", "or"
        or "&" either (:mod:`~formcast.grammars.grounding_source`).
    """

    strings: frozenset[tuple[str, ...]] = frozenset()
    numbers: frozenset[tuple[str, ...]] = frozenset()
    integers: frozenset[tuple[str, ...]] = frozenset()
    words: bool = False
    capitalise: bool = False
    clauses: bool = False

    def __bool__(self) -> bool:
        return bool(self.strings or self.numbers)

    @cached_property
    def tree(self) -> PlanNode | None:
        """The plan as a tree of :class:`PlanNode` (None when nothing is grounded)."""
        if not self:
            return None
        root = PlanNode()
        for path in self.strings:
            root.at(path).string = True
        for path in self.numbers:
            root.at(path).number = True
        for path in self.integers & self.numbers:
            root.at(path).integer = True
        return root


def grounding_plan(schema: dict, mode: str = "auto", *, words: bool = False,
                   capitalise: bool = False, clauses: bool = False) -> GroundingPlan:
    """Find the grounded values of documents of ``schema``. Does not change ``schema``.

    The schema is walked through ``properties``, ``items``/``prefixItems`` (any
    index: ``"*"``), ``allOf``/``anyOf``/``oneOf`` and local ``$ref`` (to ``$defs``
    or ``definitions``); a recursive ``$ref`` is followed three levels deep (values
    nested deeper are not grounded), and ``additionalProperties`` and
    ``patternProperties`` are not followed. ``str | None`` (anyOf string, null) grounds the string
    and leaves null allowed.

    Parameters
    ----------
    schema : dict
        A JSON Schema (e.g. ``Model.model_json_schema()``).
    mode : {"auto", "strict", "off"}
        "off": nothing is grounded. "auto": every plain string (no ``enum``,
        ``const``, ``pattern`` or ``format``) unless marked ``"x-grounded": false``,
        and every value marked ``"x-grounded": true`` (numbers too; a mark on an
        object or array holds for everything inside it). "strict": "auto" plus
        every number and integer.
    words, capitalise, clauses : bool
        How grounded strings match the text (see :class:`GroundingPlan`).

    Returns
    -------
    GroundingPlan

    Raises
    ------
    ConstraintError
        An unknown mode, or a ``$ref`` that leads nowhere in the schema.
    """
    if mode not in MODES:
        raise ConstraintError(f"grounding mode must be one of {MODES}, got {mode!r}")
    if mode == "off" or not isinstance(schema, (dict, bool)):
        return GroundingPlan(words=words, capitalise=capitalise, clauses=clauses)
    strings: set[tuple[str, ...]] = set()
    numbers: set[tuple[str, ...]] = set()
    fractional: set[tuple[str, ...]] = set()   # (paths some schema there lets be a non-integer)

    def walk(node: Any, path: tuple[str, ...], mark: bool | None, refs: tuple[str, ...]) -> None:
        if not isinstance(node, dict):
            return
        own = node.get(KEYWORD)
        if isinstance(own, bool):
            mark = own
        ref = node.get("$ref")
        if isinstance(ref, str):
            if refs.count(ref) >= _RECURSION:
                return
            if not ref.startswith("#"):
                raise ConstraintError(f"grounding: only local $ref can be followed, got {ref!r}")
            try:
                target = lookup(schema, ref)
            except KeyError:
                raise ConstraintError(f"grounding: $ref {ref!r} leads nowhere in the "
                                      "schema") from None
            walk(target, path, mark, refs + (ref,))
        for key in ("allOf", "anyOf", "oneOf"):
            for sub in node.get(key, ()) if isinstance(node.get(key), list) else ():
                walk(sub, path, mark, refs)
        types = node.get("type")
        types = {types} if isinstance(types, str) else set(types or ())
        fixed = any(k in node for k in ("enum", "const"))
        if "string" in types and not fixed and (
                mark is True or (mark is None and not any(k in node for k in _NOT_PLAIN))):
            strings.add(path)
        if types & {"number", "integer"} and not fixed and (
                mark is True or (mark is None and mode == "strict")):
            numbers.add(path)
            if "number" in types:
                fractional.add(path)
        props = node.get("properties")
        if isinstance(props, dict):
            for name, sub in props.items():
                walk(sub, path + (name,), mark, refs)
        items = node.get("items")
        if isinstance(items, dict):
            walk(items, path + (ANY_INDEX,), mark, refs)
        elif isinstance(items, list):                   # (draft 4 to 2019-09 tuples)
            for sub in items:
                walk(sub, path + (ANY_INDEX,), mark, refs)
        for sub in node.get("prefixItems", ()) if isinstance(node.get("prefixItems"), list) \
                else ():
            walk(sub, path + (ANY_INDEX,), mark, refs)

    walk(schema, (), None, ())
    return GroundingPlan(strings=frozenset(strings), numbers=frozenset(numbers),
                         integers=frozenset(numbers - fractional), words=words,
                         capitalise=capitalise, clauses=clauses)


def ground(matcher: Matcher, text: str, plan: GroundingPlan, vocabulary: Vocabulary, *,
           distinct_items: bool = False, stop_loops: bool = False) -> Matcher:
    """Wrap a JSON-Schema matcher so that its grounded values come from ``text``.

    Does not change ``matcher`` beyond what the wrapper's own calls do; the wrapper
    owns it from now on. The mask is the matcher's AND grounding's; where that
    leaves no token, the matcher's alone (the schema always holds), and the
    wrapper's ``violations`` records which value left the text.

    Parameters
    ----------
    matcher : Matcher
        A fresh matcher of a JSON Schema (``CompiledGrammar.matcher()``).
    text : str
        The source text grounded values come from.
    plan : GroundingPlan
        Which values are grounded (:func:`grounding_plan`).
    vocabulary : Vocabulary
        The vocabulary the matcher's grammar was compiled for
        (``CompiledGrammar.vocab``).
    distinct_items : bool
        When an array item ends equal to an earlier sibling, the array must close
        next (whitespace and ``]`` only); ``repeats`` then names the item.
    stop_loops : bool
        When a plain string ends with one unit repeated again and again
        (:func:`~formcast.grammars.grounded_matcher.looping`), the string must close
        next.

    Returns
    -------
    GroundedMatcher
    """
    from formcast.grammars.grounded_matcher import GroundedMatcher

    if not isinstance(plan, GroundingPlan):
        raise ConstraintError(f"plan must be a GroundingPlan (see grounding_plan), got "
                              f"{type(plan).__name__}")
    return GroundedMatcher(matcher, text, plan, vocabulary, distinct_items=distinct_items,
                           stop_loops=stop_loops)
