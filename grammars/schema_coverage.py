"""What each mask backend enforces of a JSON Schema, keyword by keyword.

Every keyword of a schema gets one status:

``mask``
    The token mask enforces it: no output can violate it.
``end``
    The mask enforces it only approximately (or not at all); the finished document
    is validated with ``jsonschema`` and the stop token is refused until it passes.
``annotation``
    It constrains nothing (title, description, ...).
``unsupported``
    Neither: compiling raises :class:`~formcast.ConstraintError` listing it.

The tables below were established by probing each backend (see
tests/grammars/test_schema_coverage.py, which re-checks the ``mask`` claims).
Satisfiability problems found on the way (minimum > maximum, an empty enum, a
required property the object cannot have) are errors too, with a JSON pointer.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema

from formcast.grammars.errors import ConstraintError
from formcast.grammars import regex_dialect

Status = Literal["mask", "end", "annotation", "unsupported"]

ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$comment", "$schema", "$id", "$anchor",
    "deprecated", "readOnly", "writeOnly", "contentMediaType", "contentEncoding",
    "contentSchema", "discriminator", "$defs", "definitions", "$dynamicAnchor", "$vocabulary",
})
# Keywords whose value holds subschemas: one schema, a list, or a name -> schema map.
SUB_ONE = ("additionalProperties", "items", "contains", "propertyNames", "not", "if", "then",
           "else", "unevaluatedItems", "unevaluatedProperties")
SUB_LIST = ("prefixItems", "anyOf", "oneOf", "allOf")
SUB_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Keywords formcast can only check on the finished document, whatever the backend.
END_ONLY = frozenset({
    "oneOf", "not", "if", "then", "else", "dependentRequired", "dependentSchemas",
    "uniqueItems", "contains", "minContains", "maxContains",
    "propertyNames", "unevaluatedItems", "unevaluatedProperties",
})
FORMAT_CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER
_FORMAT_CHECKS = frozenset(FORMAT_CHECKER.checkers)
_INT64 = 2 ** 63


@dataclass(frozen=True)
class BackendProfile:
    """The JSON Schema keywords (and formats) one backend's mask enforces exactly."""

    name: str
    mask: frozenset[str]
    formats: frozenset[str]
    numeric_bounds: bool          # minimum/maximum/exclusive* on integers and numbers
    integer_multiple_of: bool
    prefix_items_with_bounds: bool
    object_size: bool             # minProperties / maxProperties
    int64_bounds_only: bool
    exact_formats: frozenset[str] = frozenset()   # the mask implies jsonschema's check
    # String length bounds up to this are masked exactly (as a bounded character class);
    # larger ones use the backend's own length bound, which compiles in constant time
    # but admits raw control characters (refused by the end check).
    exact_length_limit: int | None = None
    # The largest integer multipleOf the mask follows (a larger one it ignores).
    integer_multiple_limit: int = 0


_COMMON_MASK = frozenset({"type", "enum", "const", "properties", "required",
                          "additionalProperties", "items", "minItems", "maxItems", "minLength",
                          "maxLength", "pattern", "anyOf", "$ref", "prefixItems", "format",
                          "allOf"})
PROFILES = {
    "xgrammar": BackendProfile(
        name="xgrammar", mask=_COMMON_MASK | {
            "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
            "minProperties", "maxProperties", "patternProperties"},
        numeric_bounds=True, integer_multiple_of=True,
        prefix_items_with_bounds=True, object_size=True, int64_bounds_only=True,
        formats=frozenset({"date", "time", "date-time", "duration", "email", "hostname", "ipv4",
                           "ipv6", "uri", "uri-reference", "uri-template", "json-pointer",
                           "relative-json-pointer", "uuid"}),
        # Not ipv4/ipv6 (the mask allows leading zeros), nor date (it allows 11-31).
        exact_formats=frozenset({"email", "uuid"}), exact_length_limit=64,
        integer_multiple_limit=1024),
    "outlines-core": BackendProfile(
        name="outlines-core", mask=_COMMON_MASK, numeric_bounds=False,
        integer_multiple_of=False, prefix_items_with_bounds=False, object_size=False,
        int64_bounds_only=False,
        # Its time, email and uri regexes can emit invalid JSON (raw control characters,
        # unescaped backslashes or quotes), so those formats are not used.
        formats=frozenset({"date", "date-time", "uuid"}), exact_formats=frozenset({"uuid"})),
}


@dataclass(frozen=True, kw_only=True)
class KeywordCoverage:
    """How one keyword at one place of a schema is enforced."""

    pointer: str
    keyword: str
    status: Status
    note: str = ""


@dataclass(frozen=True, kw_only=True)
class SchemaCoverage:
    """The keyword-by-keyword report :func:`explain` returns."""

    backend: str
    items: tuple[KeywordCoverage, ...]
    # What building the grammar noticed (the mask library's own warnings).
    warnings: tuple[str, ...] = ()

    def with_status(self, status: Status) -> tuple[KeywordCoverage, ...]:
        """The entries of one status."""
        return tuple(i for i in self.items if i.status == status)

    @property
    def needs_end_check(self) -> bool:
        return any(i.status == "end" for i in self.items)

    def __str__(self) -> str:
        rows = [f"JSON Schema coverage ({self.backend} backend)"]
        for i in self.items:
            note = f"  -- {i.note}" if i.note else ""
            rows.append(f"  {i.status:<11} {i.pointer}/{i.keyword}{note}")
        rows += [f"  warning     {w}" for w in self.warnings]
        return "\n".join(rows)


def pointer_join(pointer: str, *parts: object) -> str:
    """Append JSON-pointer segments (escaping ``~`` and ``/``)."""
    for p in parts:
        pointer += "/" + str(p).replace("~", "~0").replace("/", "~1")
    return pointer


def subschemas(node: dict, pointer: str) -> Iterator[tuple[Any, str]]:
    """(subschema, pointer) for each schema directly inside ``node``."""
    for kw in SUB_ONE:
        if kw in node:
            yield node[kw], pointer_join(pointer, kw)
    for kw in SUB_LIST:
        for i, sub in enumerate(node.get(kw, ()) or ()):
            yield sub, pointer_join(pointer, kw, i)
    for kw in SUB_MAP:
        for name, sub in (node.get(kw) or {}).items():
            yield sub, pointer_join(pointer, kw, name)


def analyze(root: Any, backend: str, *, strict: bool = True) -> SchemaCoverage:
    """Classify every keyword of a metaschema-valid draft-2020-12 schema; raise on
    unsatisfiable parts. ``strict``: objects without additionalProperties are closed."""
    profile = PROFILES[backend]
    items: list[KeywordCoverage] = []
    if root is False:
        raise ConstraintError("#: the schema `false` accepts no document")
    stack: list[tuple[Any, str]] = [(root, "#")]
    while stack:
        node, pointer = stack.pop()
        if not isinstance(node, dict):
            continue
        check_satisfiable(root, node, pointer, profile)
        for kw, value in node.items():
            status, note = classify(kw, value, node, profile)
            items.append(KeywordCoverage(pointer=pointer, keyword=kw, status=status, note=note))
        if strict and "properties" in node and not any(k in node for k in (
                "additionalProperties", "patternProperties", "unevaluatedProperties")):
            items.append(KeywordCoverage(
                pointer=pointer, keyword="additionalProperties", status="mask",
                note="not given: only the listed properties are generated (a narrowing)"))
        stack.extend(reversed(list(subschemas(node, pointer))))
    return SchemaCoverage(backend=backend, items=tuple(items))


def classify(kw: str, value: Any, node: dict, p: BackendProfile) -> tuple[Status, str]:
    """The status of keyword ``kw`` inside ``node`` for backend profile ``p``."""
    if kw in ANNOTATIONS or kw.startswith("x-"):
        return "annotation", ""
    if kw == "$dynamicRef":
        return "mask", "resolved like $ref (its anchor name is unique in the schema)"
    if kw in END_ONLY:
        note = "masked as anyOf; 'exactly one' is checked at the end" if kw == "oneOf" else ""
        return "end", note
    if kw == "format":
        known, checkable = value in p.formats, value in _FORMAT_CHECKS
        if known and value in p.exact_formats:
            return "mask", ""
        if known and checkable:
            return "end", "the mask enforces the shape; jsonschema checks the value at the end"
        if known:
            return "mask", (f"{p.name}'s pattern for {value!r} (its shape; jsonschema has no "
                            "checker for it here)")
        if checkable:
            return "end", f"{p.name} does not know format {value!r}"
        return "annotation", f"format {value!r} is unknown: ignored"
    if kw in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        if p.int64_bounds_only and node.get("type") == "integer" and not -_INT64 < value < _INT64:
            return "unsupported", f"{p.name} takes integer bounds within +-2**63 only"
        return ("mask", "") if p.numeric_bounds else ("end", "")
    if kw == "multipleOf":
        if p.integer_multiple_of and node.get("type") == "integer" and float(
                value).is_integer() and value <= p.integer_multiple_limit and not any(
                k in node for k in (
                    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
            return "mask", ""
        return "end", ""
    if kw in ("minLength", "maxLength") and ("pattern" in node or "format" in node):
        return "end", "length bounds next to a pattern/format are checked at the end"
    if kw in ("minLength", "maxLength") and p.exact_length_limit is not None and max(
            node.get("minLength", 0), node.get("maxLength", 0)) > p.exact_length_limit:
        return "end", ("the mask bounds the length (escapes are not generated); a raw control "
                       "character it lets through is refused at the end")
    if kw in ("minItems", "maxItems", "items", "prefixItems") and "prefixItems" in node:
        if not p.prefix_items_with_bounds:
            return "end", ""
        if kw == "maxItems" and value < len(node["prefixItems"]):
            return "unsupported", f"{p.name} cannot take maxItems below the number of prefixItems"
    if kw in ("minProperties", "maxProperties"):
        return ("mask", "") if p.object_size else ("end", "")
    if kw == "pattern":
        try:
            found = regex_dialect.schema_pattern(value, where="pattern")
        except ConstraintError as exc:
            return "unsupported", str(exc)
        if not found.exact:
            return "end", found.note
        return "mask", "an unanchored pattern allows any text around its match (re.search)"
    if kw == "additionalProperties" and value is not False and node.get("patternProperties"):
        return "end", ""
    if kw == "patternProperties":
        return "end", "key patterns are masked; which schema applies to a key is checked at the end"
    if kw == "required":
        return "mask", ""
    if kw == "properties":
        return "mask", "generated in the order listed"
    if kw == "allOf":
        return "mask", "merged into the parent schema"
    if kw == "$ref" and p.name == "outlines-core":
        return "mask", "recursion is unrolled to depth 3 (deeper documents cannot be generated)"
    if kw in p.mask:
        return "mask", ""
    return "end", f"{p.name} does not enforce it"


def check_satisfiable(root: Any, node: dict, pointer: str, p: BackendProfile) -> None:
    """Raise ConstraintError (with a JSON pointer) for parts no value can satisfy."""
    def fail(kw: str, why: str) -> ConstraintError:
        return ConstraintError(f"{pointer_join(pointer, kw)}: {why}")

    for lo_kw, hi_kw in (("minLength", "maxLength"), ("minItems", "maxItems"),
                         ("minProperties", "maxProperties"), ("minContains", "maxContains")):
        if lo_kw in node and hi_kw in node and node[lo_kw] > node[hi_kw]:
            raise fail(lo_kw, f"{lo_kw} {node[lo_kw]} > {hi_kw} {node[hi_kw]}: unsatisfiable")
    _check_numbers(node, fail)
    if "enum" in node and not node["enum"]:
        raise fail("enum", "empty enum: no value is allowed")
    for kw in ("enum", "const"):
        if kw in node:
            values = node["enum"] if kw == "enum" else [node["const"]]
            if not _some_value_fits(root, node, values):
                raise fail(kw, f"no {kw} value satisfies the other keywords of this schema")
    props = node.get("properties") or {}
    for name in node.get("required") or ():
        if props.get(name) is False:
            raise fail("required", f"required property {name!r} has the schema false")
        if name not in props and node.get("additionalProperties") is False and not any(
                pattern_search(pat, name) for pat in node.get("patternProperties") or {}):
            raise fail("required", f"required property {name!r} is not allowed "
                                   "(additionalProperties is false and it is not in properties)")


def _check_numbers(node: dict, fail) -> None:
    lo, xlo = node.get("minimum"), node.get("exclusiveMinimum")
    hi, xhi = node.get("maximum"), node.get("exclusiveMaximum")
    kw = "minimum" if lo is not None else "exclusiveMinimum"
    if node.get("type") == "integer":
        firsts = ([math.ceil(lo)] if lo is not None else []) + (
            [math.floor(xlo) + 1] if xlo is not None else [])
        lasts = ([math.floor(hi)] if hi is not None else []) + (
            [math.ceil(xhi) - 1] if xhi is not None else [])
        if firsts and lasts and max(firsts) > min(lasts):
            raise fail(kw, "no integer lies within the bounds: unsatisfiable")
        return
    lows = [(v, closed) for v, closed in ((lo, True), (xlo, False)) if v is not None]
    highs = [(v, closed) for v, closed in ((hi, True), (xhi, False)) if v is not None]
    for low, low_closed in lows:
        for high, high_closed in highs:
            if low > high or (low == high and not (low_closed and high_closed)):
                raise fail(kw, "the lower bound is above the upper bound: unsatisfiable")


def _some_value_fits(root: Any, node: dict, values: list) -> bool:
    rest = {k: v for k, v in node.items() if k not in ("enum", "const") and k not in ANNOTATIONS}
    if not rest:
        return True
    if isinstance(root, dict):
        for defs in ("$defs", "definitions"):
            if defs in root:
                rest.setdefault(defs, root[defs])
    validator = jsonschema.Draft202012Validator(rest)
    try:
        return any(validator.is_valid(v) for v in values)
    except Exception:  # a $ref into the root's structure: leave it to the end check
        return True


def pattern_search(pattern: str, text: str) -> bool:
    """Whether ``pattern`` matches somewhere in ``text`` (False for a pattern
    Python's ``re`` cannot read)."""
    try:
        return re.search(pattern, text) is not None
    except re.error:
        return False
