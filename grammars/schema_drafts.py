"""JSON Schema drafts: pick the draft of a schema and rewrite it into draft 2020-12 form.

The rest of the JSON Schema pipeline (analysis, satisfiability, the rewrite for a
backend) sees draft 2020-12 only. :func:`normalise` turns the keywords of drafts
04, 06, 07 and 2019-09 (and OpenAPI 3.0's ``nullable``) into their 2020-12
equivalents, and takes unknown keywords out, listing them as annotations (with a
warning for those that look like a misspelt keyword). The end check still
validates the caller's original schema with the validator class of its draft.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import Any
from urllib.parse import unquote

import jsonschema
import jsonschema.validators

from formcast.grammars.errors import ConstraintError

# Keywords of draft 2020-12 that constrain the value (a typo of one of these warns).
ASSERTIONS = frozenset({
    "$ref", "$dynamicRef", "prefixItems", "items", "contains", "additionalProperties",
    "properties", "patternProperties", "dependentSchemas", "propertyNames", "if", "then", "else",
    "allOf", "anyOf", "oneOf", "not", "unevaluatedItems", "unevaluatedProperties", "type", "const",
    "enum", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "maxItems", "minItems", "uniqueItems", "maxContains",
    "minContains", "maxProperties", "minProperties", "required", "dependentRequired", "format",
})
# Keywords of draft 2020-12 that constrain nothing (kept: $ref resolution reads some).
META = frozenset({
    "$schema", "$id", "$anchor", "$dynamicAnchor", "$vocabulary", "$comment", "$defs",
    "definitions", "title", "description", "default", "deprecated", "readOnly", "writeOnly",
    "examples", "contentEncoding", "contentMediaType", "contentSchema",
})
KNOWN = ASSERTIONS | META
_DRAFTS = {
    jsonschema.Draft4Validator: "04", jsonschema.Draft6Validator: "06",
    jsonschema.Draft7Validator: "07", jsonschema.Draft201909Validator: "2019-09",
    jsonschema.Draft202012Validator: "2020-12",
}
# Schemas inside these keywords (one schema / a list / a name -> schema map), in any draft.
_ONE = ("additionalProperties", "items", "contains", "propertyNames", "not", "if", "then", "else",
        "unevaluatedItems", "unevaluatedProperties", "additionalItems", "contentSchema")
_LIST = ("prefixItems", "anyOf", "oneOf", "allOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_VALUES = frozenset({"const", "enum", "default", "examples", "example"})
# $defs names of copied reference targets (see _stranded_targets)
STRANDED = "__formcast_target"


class SchemaKeywordWarning(UserWarning):
    """An unknown JSON Schema keyword looks like a misspelt known one (it is ignored)."""


@dataclass(frozen=True, kw_only=True)
class Normalised:
    """A schema rewritten into draft 2020-12 form, with what the rewrite set aside."""

    schema: Any
    draft: str                                   # "04", "06", "07", "2019-09" or "2020-12"
    validator: type                              # jsonschema validator class of ``original``
    original: Any                                # what the end check validates
    ignored: tuple[tuple[str, str, str], ...]    # (pointer, keyword, note) of annotations


def draft_of(schema: Any) -> tuple[str, type]:
    """The draft a schema declares with ``$schema`` (absent or unknown: 2020-12)."""
    if not isinstance(schema, dict) or "$schema" not in schema:
        return "2020-12", jsonschema.Draft202012Validator
    uri = schema["$schema"]
    if isinstance(uri, str) and "draft-03" in uri:
        raise ConstraintError("#/$schema: draft 3 is not supported; use draft 4 or later")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return _DRAFTS.get(cls, "2020-12"), cls if cls in _DRAFTS else jsonschema.Draft202012Validator


def normalise(schema: Any) -> Normalised:
    """Rewrite ``schema`` (a parsed, metaschema-checked document) into 2020-12 form.

    Does not change ``schema``. Warns (:class:`SchemaKeywordWarning`) once per
    unknown keyword that looks like a misspelt assertion keyword.
    """
    draft, validator = draft_of(schema)
    ignored: list[tuple[str, str, str]] = []
    stranded = _stranded_targets(schema, draft)
    out = _node(schema, "#", draft, ignored, stranded)
    if stranded and isinstance(out, dict):
        # a reference into what normalising drops or moves keeps a copy of its target
        defs = out.setdefault("$defs", {})
        for target, name in stranded.items():
            defs[name] = _node(_at(schema, target), target, draft, ignored, stranded)
    typos: dict[str, tuple[str, str]] = {}
    for pointer, kw, note in ignored:
        if "did you mean" in note:
            typos.setdefault(kw, (pointer, note.split("; ", 1)[1]))
    for kw, (pointer, guess) in typos.items():
        warnings.warn(f"JSON Schema keyword {kw!r} at {pointer} is unknown and ignored; {guess}",
                      SchemaKeywordWarning, stacklevel=2)
    # A 2020-12 schema is checked in its normalised form, which also understands the
    # older keywords (dependencies, definitions, nullable) the mask was built from.
    original = schema if draft != "2020-12" else out
    return Normalised(schema=out, draft=draft, validator=validator, original=original,
                      ignored=tuple(ignored))


@lru_cache(maxsize=4096)
def looks_like(keyword: str) -> str | None:
    """The assertion keyword an unknown ``keyword`` likely misspells, or None."""
    low = keyword.lower()
    for known in sorted(ASSERTIONS):
        k = known.lower()
        if low == k or (len(k) >= 4 and abs(len(k) - len(low)) <= 1 and _distance(low, k) <= 1):
            return known
    return None


def _distance(a: str, b: str) -> int:
    """Edit distance counting an adjacent transposition as one edit."""
    if abs(len(a) - len(b)) > 1:
        return 2
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        cur = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[-1]


def _join(pointer: str, *parts: object) -> str:
    for p in parts:
        pointer += "/" + str(p).replace("~", "~0").replace("/", "~1")
    return pointer


def _stranded_targets(schema: Any, draft: str) -> dict[str, str]:
    """Local references whose target normalising drops or moves: pointer -> $defs name.

    Real schemas point into places that are not schemas to JSON Schema: a group of
    definitions under an unknown keyword (``#/$defs/plugins/extractor``), a draft-7
    array-form ``items`` entry, a ``dependencies`` entry. Only plain ``#/...``
    pointers outside any nested ``$id`` are looked at (elsewhere the base differs).
    """
    found: dict[str, str] = {}
    stack: list[tuple[Any, bool]] = [(schema, False)]
    while stack:
        node, scoped = stack.pop()
        if isinstance(node, list):
            stack.extend((v, scoped) for v in node)
            continue
        if not isinstance(node, dict):
            continue
        scoped = scoped or (node is not schema and isinstance(node.get("$id"), str)) or (
            node is not schema and draft == "04" and isinstance(node.get("id"), str)
            and not node["id"].startswith("#"))
        ref = node.get("$ref")
        if (not scoped and isinstance(ref, str) and ref.startswith("#/") and ref not in found
                and _exists(schema, ref) and not _kept(schema, ref, draft)):
            found[ref] = f"{STRANDED}{len(found)}"
        stack.extend((v, scoped) for k, v in node.items() if k not in _VALUES)
    return found


def _segments(pointer: str) -> list[str]:
    return [unquote(p).replace("~1", "/").replace("~0", "~") for p in pointer[2:].split("/")]


def _exists(schema: Any, pointer: str) -> bool:
    try:
        _at(schema, pointer)
    except (KeyError, IndexError, TypeError, ValueError):
        return False
    return True


def _at(schema: Any, pointer: str) -> Any:
    node = schema
    for part in _segments(pointer):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def _kept(schema: Any, pointer: str, draft: str) -> bool:
    """Whether the schema at ``pointer`` keeps its place when normalised."""
    node, parts = schema, _segments(pointer)
    i = 0
    while i < len(parts):
        kw = parts[i]
        if not isinstance(node, dict) or (draft in ("04", "06", "07") and "$ref" in node
                                          and kw not in ("definitions", "$defs")):
            return False
        if kw in _ONE and kw != "additionalItems":
            node, i = node[kw], i + 1
        elif (kw in _LIST or kw in _MAP) and i + 1 < len(parts):
            value = node[kw]
            node = value[int(parts[i + 1])] if isinstance(value, list) else value[parts[i + 1]]
            i += 2
        else:
            return False
    return True


def _node(node: Any, pointer: str, draft: str, ignored: list,
          stranded: dict[str, str] | None = None) -> Any:
    if not isinstance(node, dict):
        return node
    stranded = stranded or {}
    old = draft in ("04", "06", "07")
    if old and "$ref" in node:
        # Before 2019-09 the siblings of $ref are ignored; the definitions stay reachable.
        node = {k: v for k, v in node.items() if k in ("$ref", "definitions", "$defs")}
    if node.get("$ref") in stranded:
        node = {**node, "$ref": f"#/$defs/{stranded[node['$ref']]}"}
    out: dict[str, Any] = {}
    for kw, value in node.items():
        where = _join(pointer, kw)
        if kw in _ONE:
            out[kw] = _node(value, where, draft, ignored, stranded)
        elif kw in _LIST and isinstance(value, list):
            out[kw] = [_node(s, _join(where, i), draft, ignored, stranded)
                       for i, s in enumerate(value)]
        elif kw in _MAP and isinstance(value, dict):
            out[kw] = {k: _node(s, _join(where, k), draft, ignored, stranded)
                       for k, s in value.items()}
        elif kw == "dependencies" and isinstance(value, dict):
            for name, dep in value.items():
                if isinstance(dep, list):
                    out.setdefault("dependentRequired", {})[name] = dep
                else:
                    out.setdefault("dependentSchemas", {})[name] = _node(
                        dep, _join(where, name), draft, ignored, stranded)
        elif kw == "items" and isinstance(value, list):
            out[kw] = [_node(s, _join(where, i), draft, ignored, stranded)
                       for i, s in enumerate(value)]
        elif kw in ("id", "$id") and isinstance(value, str) and (kw == "$id" or draft == "04" or (
                "$id" not in node and draft == "2020-12")):
            _identify(out, value)
        elif kw in ("$recursiveRef", "$recursiveAnchor") and draft == "2019-09":
            if kw == "$recursiveRef":
                out["$ref"] = value
        elif kw == "nullable":
            if value is not True:
                continue
            out["nullable"] = True
        elif kw in KNOWN or kw == "additionalItems":
            out[kw] = value
        else:
            guess = None if kw.startswith("x-") else looks_like(kw)
            ignored.append((pointer, kw, "ignored" + (f"; did you mean {guess!r}?" if guess
                                                      else "")))
    _arrays(out)
    _exclusive_bounds(out)
    if out.pop("nullable", False):
        _add_null(out)
    return out


def _identify(out: dict, uri: str) -> None:
    """An id: a base URI change, or (a bare fragment, as in drafts 04-07) an anchor."""
    if uri.startswith("#"):
        if len(uri) > 1:
            out["$anchor"] = uri[1:]
        return
    base, _, fragment = uri.partition("#")
    out["$id"] = base
    if fragment and not fragment.startswith("/"):
        out["$anchor"] = fragment


def _arrays(out: dict) -> None:
    """Array-form ``items`` + ``additionalItems`` -> ``prefixItems`` + ``items``."""
    extra = out.pop("additionalItems", None)
    if isinstance(out.get("items"), list):
        out["prefixItems"] = out.pop("items")
        if extra is not None:
            out["items"] = extra


def _exclusive_bounds(out: dict) -> None:
    """Draft 04's boolean exclusiveMinimum/Maximum -> the numeric form."""
    for flag, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(out.get(flag), bool):
            if out.pop(flag) and bound in out:
                out[flag] = out.pop(bound)


def _add_null(out: dict) -> None:
    """OpenAPI 3.0 ``nullable: true``: null is allowed besides what ``type`` says."""
    if "type" in out:
        types = out["type"] if isinstance(out["type"], list) else [out["type"]]
        if "null" not in types:
            out["type"] = [*types, "null"]
    if "enum" in out and None not in out["enum"]:
        out["enum"] = [*out["enum"], None]
