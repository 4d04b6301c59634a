"""Which JSON types a schema admits, and a JSON-pointer error when it admits none.

:func:`inhabited` computes, for every subschema, a set of JSON types that is a
superset of the types its valid values can have (keywords it cannot reason about
restrict nothing), as the least fixpoint over the ``$ref`` graph: a recursion that
every instance must take again has no finite instance, so it comes out empty.
When the root comes out empty, :func:`check_root` names the part responsible.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jsonschema

from formcast.grammars.errors import ConstraintError
from formcast.grammars.schema_coverage import pattern_search
from formcast.grammars.schema_refs import children, join, lookup

ALL = frozenset({"null", "boolean", "integer", "fraction", "string", "array", "object"})
_TYPES = {"null": {"null"}, "boolean": {"boolean"}, "integer": {"integer"},
          "number": {"integer", "fraction"}, "string": {"string"}, "array": {"array"},
          "object": {"object"}}
_NO_CONSTRAINT = frozenset({"title", "description", "default", "examples", "$comment", "$id",
                            "$anchor", "$schema", "deprecated", "readOnly", "writeOnly", "$defs",
                            "definitions", "$dynamicAnchor", "$vocabulary"})
_LOWER = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_UPPER = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")
Types = frozenset[str]
Reason = Callable[[str], None]


def type_of(value: Any) -> str:
    """The JSON type of a Python value (a float with no fraction counts as integer)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "fraction"
    return {str: "string", list: "array", dict: "object"}[type(value)]


def is_trivial(node: Any) -> bool:
    """True for ``true`` and for schemas with nothing but annotations."""
    return node is True or (isinstance(node, dict) and not set(node) - _NO_CONSTRAINT)


class Inhabitation:
    """The fixpoint of admitted types over every subschema of one (resolved) root."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self._validator = jsonschema.Draft202012Validator(root if isinstance(root, dict) else {})
        self._types: dict[int, Types] = {}
        self._known: set[int] = set()
        self._fits: dict[tuple[int, str], set[str]] = {}
        order: list[Any] = []
        stack: list[Any] = [root]
        seen: set[int] = set()
        while stack:
            node = stack.pop()
            if id(node) in seen or not isinstance(node, (dict, bool)):
                continue
            seen.add(id(node))
            order.append(node)
            if isinstance(node, dict):
                stack.extend(sub for sub, _ in children(node, "#"))
        self._known = seen
        order.reverse()                           # children before parents, mostly
        changed = True
        while changed:
            changed = False
            for node in order:
                new = self._step(node, None)
                if new != self._types.get(id(node), frozenset()):
                    self._types[id(node)] = new
                    changed = True

    def types(self, node: Any) -> Types:
        """Types ``node`` admits (empty: no value is valid); for a schema built after the
        analysis (a merge of its subschemas), computed from its parts."""
        return self._sub(node)

    def _sub(self, node: Any) -> Types:
        if node is True:
            return ALL
        if node is False:
            return frozenset()
        if id(node) in self._known:
            return self._types.get(id(node), frozenset())
        return self._step(node, None) if isinstance(node, dict) else ALL

    def _step(self, node: Any, why: Reason | None) -> Types:
        """One evaluation of ``node`` from its children's current sets; ``why`` hears
        the name of each keyword that removes types."""
        if node is True:
            return ALL
        if node is False:
            if why:
                why("the schema is false")
            return frozenset()
        note = why or (lambda _: None)
        admitted = set(ALL)

        def cut(keep: set[str] | frozenset[str], what: str) -> None:
            if admitted - set(keep):
                before = set(admitted)
                admitted.intersection_update(keep)
                if before and not admitted:
                    note(what)

        if "type" in node:
            names = node["type"] if isinstance(node["type"], list) else [node["type"]]
            cut(set().union(*(_TYPES.get(t, set()) for t in names)), "type")
        for kw in ("const", "enum"):
            if kw in node:
                cut(self._value_types(node, kw), kw)
        if "not" in node and is_trivial(node["not"]):
            cut(set(), "not (every value matches its schema)")
        for i, branch in enumerate(node.get("allOf") or ()):
            cut(self._sub(branch), f"allOf/{i}")
        for kw in ("anyOf", "oneOf"):
            if kw in node:
                cut(set().union(*(self._sub(b) for b in node[kw])), kw)
        if isinstance(node.get("$ref"), str):
            cut(self._sub(_target(self.root, node["$ref"])), "$ref")
        view = _bounds(node)
        if "string" in admitted and view.get("minLength", 0) > view.get("maxLength", math.inf):
            cut(admitted - {"string"}, "minLength")
        self._numbers(view, admitted, cut)
        if "array" in admitted and not self._array_fits(view):
            cut(admitted - {"array"}, "minItems")
        if "object" in admitted and (missing := self._object_misfit(view)):
            cut(admitted - {"object"}, missing)
        return frozenset(admitted)

    def _value_types(self, node: dict, kw: str) -> set[str]:
        key = (id(node), kw)
        if key not in self._fits:       # fixed by the values: computed once per node
            self._fits[key] = self._fitting(node, kw)
        return self._fits[key]

    def _fitting(self, node: dict, kw: str) -> set[str]:
        values = node["enum"] if kw == "enum" else [node["const"]]
        rest = {k: v for k, v in node.items() if k not in ("enum", "const")}
        if is_trivial(rest):
            return {type_of(v) for v in values}
        try:
            check = self._validator.evolve(schema=rest)
            return {type_of(v) for v in values if check.is_valid(v)}
        except Exception:   # a reference jsonschema cannot follow here: assume each fits
            return {type_of(v) for v in values}

    @staticmethod
    def _numbers(node: dict, admitted: set[str], cut) -> None:
        lo, xlo = node.get("minimum"), node.get("exclusiveMinimum")
        hi, xhi = node.get("maximum"), node.get("exclusiveMaximum")
        kw = "minimum" if lo is not None else "exclusiveMinimum"
        lows = [(v, True) for v in (lo,) if v is not None] + [(v, False) for v in (xlo,)
                                                               if v is not None]
        highs = [(v, True) for v in (hi,) if v is not None] + [(v, False) for v in (xhi,)
                                                                if v is not None]
        if any(low > high or (low == high and not (lc and hc))
               for low, lc in lows for high, hc in highs):
            cut(admitted - {"integer", "fraction"}, kw)
            return
        firsts = [math.ceil(lo)] if lo is not None else []
        firsts += [math.floor(xlo) + 1] if xlo is not None else []
        lasts = [math.floor(hi)] if hi is not None else []
        lasts += [math.ceil(xhi) - 1] if xhi is not None else []
        if firsts and lasts and max(firsts) > min(lasts):
            cut(admitted - {"integer"}, kw)

    def _array_fits(self, node: dict) -> bool:
        low, high = node.get("minItems", 0), node.get("maxItems", math.inf)
        if low > high:
            return False
        prefix = node.get("prefixItems") or []
        rest = node.get("items", True)
        for i in range(int(min(low, len(prefix) + 1))):
            if not (self._sub(prefix[i]) if i < len(prefix) else self._sub(rest)):
                return False
        if "contains" in node and node.get("minContains", 1) > 0:
            return bool(self._sub(node["contains"])) and high >= node.get("minContains", 1)
        return True

    def _object_misfit(self, node: dict) -> str:
        """The keyword that leaves no object valid, or ''."""
        props = node.get("properties") or {}
        patterns = node.get("patternProperties") or {}
        extra = node.get("additionalProperties", True)
        required = list(node.get("required") or ())
        for name in required:
            schemas = [props[name]] if name in props else []
            schemas += [s for p, s in patterns.items() if pattern_search(p, name)]
            if name not in props and len(schemas) == 0:
                schemas = [extra]
            if any(not self._sub(s) for s in schemas):
                return "required"
        low, high = node.get("minProperties", 0), node.get("maxProperties", math.inf)
        if low > high or len(set(required)) > high:
            return "maxProperties"
        if extra is False and not patterns and low > sum(1 for s in props.values()
                                                         if self._sub(s)):
            return "minProperties"
        return ""

    def explain(self, node: Any, pointer: str, seen: set[int]) -> str:
        """Why ``node`` (admitting nothing) is empty: the innermost culprit, with pointer."""
        if node is False:
            return f"{pointer}: the schema false admits no value"
        if id(node) in seen:
            return (f"{pointer}: this recursion has no finite instance (every value would "
                    "have to contain another one)")
        seen.add(id(node))
        culprit: list[str] = []
        self._step(node, culprit.append)
        if not culprit:
            return f"{pointer}: no value satisfies this schema"
        kw = culprit[0]
        sub = self._culprit_child(node, kw, pointer)
        if sub is not None:
            child, where = sub
            if not self._sub(child):
                return self.explain(child, where, seen)
        if kw.startswith("allOf") or kw in ("type", "const", "enum", "$ref"):
            return f"{join(pointer, kw.split('/')[0])}: no value satisfies it together with " \
                   f"the other keywords of {pointer} (the types they allow do not overlap)"
        return f"{join(pointer, kw.split(' ')[0])}: no value satisfies it"

    def _culprit_child(self, node: dict, kw: str, pointer: str) -> tuple[Any, str] | None:
        if kw.startswith("allOf/"):
            i = int(kw.split("/")[1])
            return node["allOf"][i], join(pointer, "allOf", i)
        if kw == "$ref":
            return _target(self.root, node["$ref"]), node["$ref"]
        if kw == "required":
            props = node.get("properties") or {}
            for name in node.get("required") or ():
                if name in props and not self._sub(props[name]):
                    return props[name], join(pointer, "properties", name)
        if kw in ("anyOf", "oneOf") and len(node[kw]) == 1:
            return node[kw][0], join(pointer, kw, 0)
        return None


def _bounds(node: dict) -> dict:
    """``node`` with the bounds of its ``allOf`` branches folded in (tightest wins)."""
    branches = [b for b in node.get("allOf") or () if isinstance(b, dict)]
    if not branches:
        return node
    view = dict(node)
    for branch in branches:
        for kw, value in _bounds(branch).items():
            if kw in _LOWER and isinstance(value, (int, float)) and not isinstance(value, bool):
                view[kw] = max(view.get(kw, value), value)
            elif kw in _UPPER and isinstance(value, (int, float)) and not isinstance(value, bool):
                view[kw] = min(view.get(kw, value), value)
    return view


def check_root(root: Any, analysis: Inhabitation) -> None:
    """Raise ConstraintError if no document is valid against ``root``."""
    if root is not True and not analysis.types(root):
        raise ConstraintError(analysis.explain(root, "#", set()))


def _target(root: Any, ref: str) -> Any:
    try:
        return lookup(root, ref)
    except KeyError:
        return True
