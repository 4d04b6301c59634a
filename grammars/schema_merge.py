"""Merging JSON Schemas: one schema that means two (an ``allOf`` folded into its parent).

:func:`merge` gives up (returns None) wherever the combined meaning is not simple
to write as one schema; the caller then widens the mask and checks at the end.
"""

from __future__ import annotations

from typing import Any

from formcast.grammars.schema_satisfiable import type_of

DROPPED = ("$id", "$anchor", "$dynamicAnchor", "$schema", "$comment", "$vocabulary", "title",
           "description", "default", "examples", "deprecated", "readOnly", "writeOnly",
           "contentEncoding", "contentMediaType", "contentSchema")
_LOWER = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties", "minContains")
_UPPER = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties", "maxContains")
_MERGE_CHILD = ("items", "contains", "propertyNames", "additionalProperties")


def merge(a: dict, b: dict) -> dict | None:
    """One schema meaning ``a`` and ``b`` both, or None where that is not simple."""
    for side, other in ((a, b), (b, a)):
        # additionalProperties and friends see only their own schema's properties;
        # items after prefixItems only the items the prefix does not cover.
        # (unevaluatedProperties sees them all: the end check decides it.)
        if "properties" in other and any(k in side for k in (
                "additionalProperties", "patternProperties")):
            return None
        if "prefixItems" in side and ("items" in other or "prefixItems" in other) and (
                side.get("prefixItems") != other.get("prefixItems")
                or side.get("items") != other.get("items")):
            return None
    out = dict(a)
    for kw, value in b.items():
        if kw not in out or same(out[kw], value) or kw in DROPPED:
            out.setdefault(kw, value)
        elif kw == "required":
            out[kw] = list(dict.fromkeys([*out[kw], *value]))
        elif kw in ("properties", "$defs", "definitions", "dependentRequired"):
            props = dict(out[kw])
            for name, sub in value.items():
                props[name] = sub if name not in props else (
                    list(dict.fromkeys([*props[name], *sub])) if kw == "dependentRequired"
                    else {"allOf": [props[name], sub]})
            out[kw] = props
        elif kw in _MERGE_CHILD:
            out[kw] = {"allOf": [out[kw], value]}
        elif kw in _LOWER:
            out[kw] = max(out[kw], value)
        elif kw in _UPPER:
            out[kw] = min(out[kw], value)
        elif kw == "enum":
            out[kw] = [v for v in out[kw] if any(same(v, w) for w in value)]
        elif kw == "type":
            mine = out[kw] if isinstance(out[kw], list) else [out[kw]]
            theirs = value if isinstance(value, list) else [value]
            both = [t for t in mine if t in theirs or (t == "integer" and "number" in theirs)]
            both += [t for t in theirs if t == "integer" and "number" in mine and t not in both]
            out[kw] = both[0] if len(both) == 1 else both
        else:
            return None
    return out


def literal(value: Any, *, numbers: bool = True) -> Any:
    """A schema whose only instance is ``value`` (up to whitespace; with ``numbers``,
    whole numbers by bounds, so 1 may be written 1.0)."""
    if isinstance(value, dict):
        return {"type": "object", "properties": {k: literal(v, numbers=numbers) for k, v in value.items()},
                "required": list(value), "additionalProperties": False}
    if isinstance(value, list):
        return {"type": "array", "prefixItems": [literal(v, numbers=numbers) for v in value], "items": False,
                "minItems": len(value)}
    if numbers and is_whole(value):
        return {"type": "number", "minimum": value, "maximum": value}
    return {"enum": [value]}


def is_whole(value: Any) -> bool:
    """A whole number the backend's number bounds can pin down (1 and 1.0 alike)."""
    return type(value) in (int, float) and float(value).is_integer() and abs(value) <= 2 ** 53


def widened(node: dict) -> dict:
    """Widen ``node`` to the spec's open objects and arrays (for a mask that must not be
    narrower than a schema it could not keep)."""
    node.setdefault("additionalProperties", True)
    node.setdefault("items", True)
    return node


def same(a: Any, b: Any) -> bool:
    """JSON equality (``1 == 1.0`` but ``1 != true``)."""
    if type_of(a) != type_of(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b
