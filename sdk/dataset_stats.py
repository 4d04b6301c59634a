"""What a generated dataset holds, field by field.

:func:`field_summary` walks every record and reports, per field path (``a.b`` for
nested objects, ``a[]`` for the items of a list): value counts for booleans and for
fields the schema declares as ``enum``/``const`` (and for small sets of integers),
min/max/mean/stdev/median for numbers, and length statistics plus the number of
distinct values for strings. A field that holds several JSON types gets one section
per type, and ``null`` is counted on its own.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

_TOP = 5            # most common string values listed for a free (non-enum) string field
_SMALL_INT_SET = 10  # integer fields with at most this many distinct values get counts


def field_summary(records: Iterable[Any], schema: dict) -> dict[str, dict[str, Any]]:
    """Per-field statistics of ``records`` (JSON values); pure function.

    Parameters
    ----------
    records : iterable of JSON values
        The ``data`` of each record.
    schema : dict
        The JSON Schema the records follow; its ``enum``/``const`` fields get value
        counts whatever their type.

    Returns
    -------
    dict
        Field path -> ``{"count": ..., "null": ..., "boolean" | "integer" | "number" |
        "string" | "array": {...}}`` (sections only for the types seen), in the order
        the fields were first met.
    """
    values: dict[str, list[Any]] = defaultdict(list)
    for record in records:
        _collect(record, "", values)
    enums = enum_paths(schema)
    return {path: _describe(vals, categorical=path in enums) for path, vals in values.items()}


def _collect(value: Any, path: str, out: dict[str, list[Any]]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _collect(item, f"{path}.{key}" if path else key, out)
        return
    name = path or "(value)"
    out[name].append(value)
    if isinstance(value, list):
        for item in value:
            _collect(item, f"{name}[]", out)


def _describe(values: list[Any], *, categorical: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"count": len(values)}
    nulls = sum(v is None for v in values)
    if nulls:
        entry["null"] = nulls
    bools = [v for v in values if isinstance(v, bool)]
    ints = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    floats = [v for v in values if isinstance(v, float)]
    strings = [v for v in values if isinstance(v, str)]
    arrays = [v for v in values if isinstance(v, list)]
    if bools:
        entry["boolean"] = {"counts": _counts(bools)}
    if ints and not floats:
        entry["integer"] = _numbers(ints, counts=categorical or len(set(ints)) <= _SMALL_INT_SET)
    elif ints or floats:
        entry["number"] = _numbers(ints + floats, counts=categorical)
    if strings:
        lengths = [len(s) for s in strings]
        section: dict[str, Any] = {"distinct": len(set(strings)), "length": _stats(lengths)}
        if categorical:
            section["counts"] = _counts(strings)
        else:
            section["top"] = [[s, c] for s, c in Counter(strings).most_common(_TOP)]
        entry["string"] = section
    if arrays:
        entry["array"] = {"length": _stats([len(a) for a in arrays])}
    return entry


def _numbers(values: list[int | float], *, counts: bool) -> dict[str, Any]:
    section = _stats(values)
    if counts:
        section["counts"] = _counts(values)
    return section


def _stats(values: list[int | float]) -> dict[str, float]:
    return {"min": min(values), "max": max(values), "mean": round(statistics.fmean(values), 4),
            "stdev": round(statistics.pstdev(values), 4),
            "median": statistics.median(values)}


def _counts(values: list[Any]) -> dict[str, int]:
    """Value -> count, keys as JSON would write them (true, 3, red), most common first."""
    def key(v: Any) -> str:
        return "true" if v is True else "false" if v is False else str(v)

    return {key(v): c for v, c in Counter(values).most_common()}


def enum_paths(schema: dict) -> set[str]:
    """Field paths (as :func:`field_summary` names them) whose schema is an enum or const."""
    found: set[str] = set()
    _walk(schema, "", schema.get("$defs", {}) | schema.get("definitions", {}), found, depth=0)
    return found


def _walk(node: Any, path: str, defs: dict, found: set[str], depth: int) -> None:
    if not isinstance(node, dict) or depth > 32:  # a recursive schema: stop somewhere
        return
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/")):
        node = {**defs.get(ref.rsplit("/", 1)[-1], {}), **{k: v for k, v in node.items()
                                                            if k != "$ref"}}
    if "enum" in node or "const" in node:
        found.add(path or "(value)")
    for key in ("anyOf", "oneOf", "allOf"):
        for option in node.get(key, []):
            _walk(option, path, defs, found, depth + 1)
    for name, prop in node.get("properties", {}).items():
        _walk(prop, f"{path}.{name}" if path else name, defs, found, depth + 1)
    if isinstance(node.get("items"), dict):
        _walk(node["items"], f"{path or '(value)'}[]", defs, found, depth + 1)
