"""JSON Schema front end: validate, report coverage, rewrite for a backend, build the end check.

The backend sees a rewritten schema with the same meaning where formcast can make
one (``allOf`` merged into its parent, required properties missing from
``properties`` added, patterns re-emitted in the portable regex dialect, keywords
that are only checked at the end removed). The end check always validates against
the caller's original schema.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema
from jsonschema.exceptions import best_match

from formcast.grammars.errors import ConstraintError
from formcast.grammars import regex_dialect
from formcast.grammars.constraints import JsonSchema
from formcast.grammars.json_spans import value_span
from formcast.grammars.matcher import EndViolation
from formcast.grammars.schema_coverage import (
    ANNOTATIONS, END_ONLY, FORMAT_CHECKER, PROFILES, SUB_LIST, SUB_MAP, SUB_ONE, BackendProfile,
    SchemaCoverage, analyze, pointer_join, resolve_ref,
)

MAX_SCHEMA_BYTES = 1 << 20
_LOWER_BOUNDS = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_UPPER_BOUNDS = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")


@dataclass(frozen=True, kw_only=True)
class PreparedSchema:
    """A schema ready for one backend."""

    text: str                                    # the rewritten schema, JSON
    coverage: SchemaCoverage
    end_check: Callable[[bytes], EndViolation | None] | None


def load_schema(constraint: JsonSchema) -> Any:
    """Parse and metaschema-check the schema; ConstraintError with the location if bad."""
    text = constraint.schema_text
    if len(text.encode("utf-8")) > MAX_SCHEMA_BYTES:
        raise ConstraintError(f"the schema is {len(text)} characters; at most "
                              f"{MAX_SCHEMA_BYTES} bytes are accepted")
    if isinstance(constraint.schema, str):
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConstraintError(f"the schema is not valid JSON: {exc.msg} at line "
                                  f"{exc.lineno}:{exc.colno}") from None
    else:
        schema = json.loads(text)   # a plain-JSON copy of the caller's mapping
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError("a JSON Schema is an object or a boolean, got "
                              f"{type(schema).__name__}")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = pointer_join("#", *exc.path)
        raise ConstraintError(f"{where}: invalid JSON Schema: {exc.message}") from None
    return schema


def explain(schema: dict | bool | str, *, backend: str = "xgrammar") -> SchemaCoverage:
    """Report, keyword by keyword, how a JSON Schema is enforced. Does not change state.

    Parameters
    ----------
    schema : dict, bool or str
        The JSON Schema (or its JSON text).
    backend : {"xgrammar", "outlines-core"}
        The mask backend the report is for.

    Returns
    -------
    SchemaCoverage
        One entry per keyword: ``mask`` (enforced by the token mask), ``end`` (checked
        on the finished document; the stop token is refused until it validates),
        ``annotation`` or ``unsupported`` (compiling it raises ConstraintError).

    Raises
    ------
    ConstraintError
        If the schema is malformed or unsatisfiable (with a JSON pointer).
    """
    if backend not in PROFILES:
        raise ValueError(f"unknown backend {backend!r}; choose from {sorted(PROFILES)}")
    return analyze(load_schema(JsonSchema(schema)), backend)


def prepare(constraint: JsonSchema, backend: str) -> PreparedSchema:
    """Validate, analyse and rewrite a schema for ``backend``.

    Raises
    ------
    ConstraintError
        Malformed, unsatisfiable, or using keywords the backend cannot enforce.
    """
    schema = load_schema(constraint)
    if backend == "outlines-core" and (schema is True or (
            isinstance(schema, dict) and not set(schema) - ANNOTATIONS)):
        # Measured: its index for "any JSON value" takes ~50 s on a 300-token vocabulary.
        raise ConstraintError("#: the outlines-core backend cannot compile an unconstrained "
                              "document ({} or true) in reasonable time; use xgrammar")
    coverage = analyze(schema, backend)
    bad = coverage.with_status("unsupported")
    if bad:
        listed = "; ".join(f"{i.pointer}/{i.keyword}" + (f" ({i.note})" if i.note else "")
                           for i in bad)
        raise ConstraintError(f"the schema uses keywords formcast cannot enforce with the "
                              f"{backend} backend: {listed}")
    rewritten = _rewrite(copy.deepcopy(schema), schema, "#", backend)
    end_check = _end_check(schema) if coverage.needs_end_check else None
    return PreparedSchema(text=json.dumps(rewritten, ensure_ascii=False), coverage=coverage,
                          end_check=end_check)


# Failures fixed by adding to a container: redo only its closing bracket.
_MISSING = frozenset({"required", "dependentRequired", "minProperties", "minItems", "contains",
                      "minContains"})


def _end_check(schema: Any) -> Callable[[bytes], EndViolation | None]:
    validator = jsonschema.Draft202012Validator(schema, format_checker=FORMAT_CHECKER)

    def check(data: bytes) -> EndViolation | None:
        try:
            text = data.decode("utf-8")
            value = json.loads(text)
        except ValueError as exc:
            return EndViolation(f"not one JSON document: {exc}", 0)
        error = best_match(validator.iter_errors(value))
        if error is None:
            return None
        path = list(error.absolute_path)
        if error.validator == "uniqueItems" and isinstance(error.instance, list):
            path.append(_first_duplicate(error.instance))
        try:
            start, end = value_span(text, path)
        except ValueError:
            start, end = 0, len(text)
        if error.validator in _MISSING and isinstance(error.instance, (dict, list)):
            start = end - 1
        return EndViolation(f"{error.json_path}: {error.message}",
                            len(text[:start].encode("utf-8")))

    return check


def _first_duplicate(items: list) -> int:
    for j in range(1, len(items)):
        if any(items[j] == items[i] and type(items[j]) is type(items[i]) for i in range(j)):
            return j
    return 0


def _rewrite(node: Any, root: Any, pointer: str, backend: str) -> Any:
    if backend == "outlines-core" and pointer != "#" and (
            node is True or (isinstance(node, dict) and not set(node) - ANNOTATIONS)):
        # outlines-core emits the any-value regex of `{}` ungrouped, so its alternatives
        # leak into the enclosing regex; as an anyOf branch it is grouped.
        return {"anyOf": [{}]}
    if not isinstance(node, dict):
        return node
    if "allOf" in node:
        merged = _merge_all_of(node, root, pointer)
        if merged is not None:
            node = merged
    _drop_unenforced(node, PROFILES[backend])
    if backend == "xgrammar" and ("minLength" in node or "maxLength" in node):
        # xgrammar's own length-bounded string lets control characters through (invalid
        # JSON); the same bounds as a pattern do not. Escapes stay out, as in xgrammar's.
        low, high = node.pop("minLength", 0), node.pop("maxLength", "")
        node["pattern"] = f'^[^"\\\\\\x00-\\x1f]{{{low},{high}}}$'
    if "pattern" in node:
        node["pattern"] = regex_dialect.translate(node["pattern"],
                                                  where=f"{pointer}/pattern")
    props = node.get("properties")
    for name in node.get("required") or ():
        if props is None:
            props = node["properties"] = {}
        if name not in props:
            extra = node.get("additionalProperties", True)
            props[name] = {} if extra is True else extra
    for kw in SUB_ONE:
        if kw in node:
            node[kw] = _rewrite(node[kw], root, pointer_join(pointer, kw), backend)
    for kw in SUB_LIST:
        if kw in node:
            node[kw] = [_rewrite(s, root, pointer_join(pointer, kw, i), backend)
                        for i, s in enumerate(node[kw])]
    for kw in SUB_MAP:
        if kw in node:
            node[kw] = {k: _rewrite(s, root, pointer_join(pointer, kw, k), backend)
                        for k, s in node[kw].items()}
    return node


def _drop_unenforced(node: dict, p: BackendProfile) -> None:
    """Remove what the backend cannot compile exactly; the end check covers it."""
    if "oneOf" in node:
        branches = node.pop("oneOf")
        node.setdefault("anyOf", branches)   # the mask allows "at least one"
    for kw in END_ONLY:
        node.pop(kw, None)
    if "format" in node and node["format"] not in p.formats:
        del node["format"]
    if not p.numeric_bounds:
        for kw in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            node.pop(kw, None)
    if "multipleOf" in node and not (p.integer_multiple_of and node.get("type") == "integer"
                                     and float(node["multipleOf"]).is_integer()):
        del node["multipleOf"]
    if not p.object_size:
        node.pop("minProperties", None)
        node.pop("maxProperties", None)
    if "prefixItems" in node and not p.prefix_items_with_bounds:
        for kw in ("prefixItems", "minItems", "maxItems"):
            node.pop(kw, None)
    if "pattern" in node or "format" in node:
        node.pop("minLength", None)
        node.pop("maxLength", None)


def _merge_all_of(node: dict, root: Any, pointer: str) -> dict | None:
    """``node`` with its ``allOf`` folded in, or None when that would change the meaning."""
    merged: dict | None = {k: v for k, v in node.items() if k != "allOf"}
    for i, branch in enumerate(node["allOf"]):
        if branch is True:
            continue
        if not isinstance(branch, dict):
            return None
        if "$ref" in branch:
            target = resolve_ref(root, branch["$ref"], pointer_join(pointer, "allOf", i))
            if not isinstance(target, dict) or target is node:
                return None
            branch = {**{k: v for k, v in branch.items() if k != "$ref"}, **target}
        merged = _merge(merged, branch)
        if merged is None:
            return None
    return merged


def _merge(a: dict, b: dict) -> dict | None:
    # additionalProperties and friends see only their own schema's properties.
    for side, other in ((a, b), (b, a)):
        if "properties" in other and any(k in side for k in (
                "additionalProperties", "patternProperties", "unevaluatedProperties")):
            return None
    out = dict(a)
    for kw, value in b.items():
        if kw not in out or out[kw] == value or kw in ANNOTATIONS:
            out.setdefault(kw, value)
        elif kw == "required":
            out[kw] = list(dict.fromkeys([*out[kw], *value]))
        elif kw == "properties":
            props = dict(out[kw])
            for name, sub in value.items():
                props[name] = sub if name not in props else {"allOf": [props[name], sub]}
            out[kw] = props
        elif kw in _LOWER_BOUNDS:
            out[kw] = max(out[kw], value)
        elif kw in _UPPER_BOUNDS:
            out[kw] = min(out[kw], value)
        elif kw == "enum":
            out[kw] = [v for v in out[kw] if v in value]
        elif kw == "type":
            mine = out[kw] if isinstance(out[kw], list) else [out[kw]]
            theirs = value if isinstance(value, list) else [value]
            both = [t for t in mine if t in theirs or (t == "integer" and "number" in theirs)]
            both += [t for t in theirs if t == "integer" and "number" in mine and t not in both]
            if not both:
                return None
            out[kw] = both[0] if len(both) == 1 else both
        else:
            return None
    return out
