"""The schema extraction generates under, and the value it gives back.

Generation runs under a copy of the caller's schema (:func:`generation_schema`)
that keeps a small model from running on until ``max_tokens`` and lets it say
that the text does not give a value:

- free strings (no ``maxLength``, ``enum``, ``const``, ``pattern`` or ``format``)
  are capped at :data:`MAX_FREE_STRING` characters, unless grounded: a span of the
  text ends where the text does, and a cap could cut it inside a word, where a
  grounded string may not end;
- a required list without ``minItems`` is written with at least one item: a small
  model otherwise closes every list at once (``"skills": []`` for "Must have: Go,
  PostgreSQL, Kafka"); a schema that allows an empty list says ``minItems: 0``;
- lists without ``maxItems`` are capped at :data:`MAX_LIST_ITEMS` items, and their
  items are distinct unless the schema says ``uniqueItems: false`` (or asks for at
  least two items without saying): the matcher ends a list at its first repeated
  item, which is dropped from the value (:func:`tidy`);
- optional fields (not required) are always written and may be ``null``; a null
  the caller's schema does not allow is dropped, so the field takes its default;
  a nullable string field that only copies another field's value is made null,
  and a list drops the items an earlier list of the same object holds (:func:`tidy`).

The output is validated against the caller's own schema afterwards.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

MAX_FREE_STRING = 64  # characters, for generation only; see the module docstring
MAX_LIST_ITEMS = 20  # items of a list without maxItems, for generation only
# generation-schema annotations: the optional properties that were made nullable,
# and whether a list's items are kept distinct
_NULL_ADDED = "x-formcast-null-added"
DISTINCT = "x-formcast-distinct"
# string keywords a stripped value could break
_SHAPED = ("enum", "const", "pattern", "format", "minLength")
# keywords whose value maps names to schemas (the names are not schema keywords)
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def generation_schema(schema: dict, *, max_string: int = MAX_FREE_STRING,
                      max_items: int = MAX_LIST_ITEMS, grounded: bool = False) -> dict:
    """The copy of ``schema`` that extraction generates under (see the module docstring).

    Does not change ``schema``. With ``grounded``, the free strings that grounding
    will hold to the text (those not marked ``"x-grounded": false`` themselves) are
    not capped.
    """
    gen = copy.deepcopy(schema)
    _walk(gen, lambda node: _cap_string(node, max_string, grounded))
    _walk(gen, _required_lists)
    _walk(gen, lambda node: _bound_list(node, max_items))
    _walk(gen, _nullable_optionals)
    return gen


def cap_free_strings(schema: dict, limit: int = MAX_FREE_STRING) -> dict:
    """A copy of ``schema`` where every string without its own length, value or
    shape bound gets ``maxLength: limit``."""
    capped = copy.deepcopy(schema)
    _walk(capped, lambda node: _cap_string(node, limit, False))
    return capped


def _walk(node: Any, visit: Callable[[dict], None]) -> None:
    """Call ``visit`` on every schema object inside ``node`` (not on data keywords)."""
    if isinstance(node, list):
        for item in node:
            _walk(item, visit)
        return
    if not isinstance(node, dict):
        return
    visit(node)
    for key, value in node.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for sub in value.values():
                _walk(sub, visit)
        elif key not in ("enum", "const", "default", "examples", "required", _NULL_ADDED):
            _walk(value, visit)


def _types(node: dict) -> list:
    types = node.get("type")
    return types if isinstance(types, list) else [types]


def _cap_string(node: dict, limit: int, grounded: bool) -> None:
    if "string" in _types(node) and not any(
            k in node for k in ("maxLength", "enum", "const", "pattern", "format")) \
            and not (grounded and node.get("x-grounded") is not False):
        node["maxLength"] = max(limit, node.get("minLength", 0))


def _bound_list(node: dict, limit: int) -> None:
    if "array" not in _types(node) or "prefixItems" in node:
        return  # (a tuple's items are positional: neither capped nor distinct)
    low = node.get("minItems", 0)
    node.setdefault("maxItems", max(limit, low))
    # distinct unless asked otherwise; a long minimum could then be out of reach
    distinct = node.pop("uniqueItems", low <= 1) is not False
    # (the matcher ends a list at its first repeated item and tidy() drops that item;
    # uniqueItems itself is checked only when the document ends, and the rollbacks
    # it takes there let a small model loop instead)
    node[DISTINCT] = distinct


def _required_lists(node: dict) -> None:
    props = node.get("properties")
    if not isinstance(props, dict):
        return
    for name in node.get("required", []):
        prop = props.get(name)
        if isinstance(prop, dict) and prop.get("type") == "array" and "minItems" not in prop \
                and "prefixItems" not in prop:
            prop["minItems"] = 1


def lists_distinct(gen: dict) -> bool:
    """Whether every list of the generation schema ``gen`` keeps its items distinct."""
    found = []
    _walk(gen, lambda node: found.append(node.get(DISTINCT, True)))
    return all(found)


def _nullable_optionals(node: dict) -> None:
    props = node.get("properties")
    if not isinstance(props, dict) or not props:
        return
    required = list(node.get("required", []))
    added = []
    for name, prop in props.items():
        if name in required:
            continue
        required.append(name)
        if not (isinstance(prop, dict) and _allows_null(prop)):
            props[name] = {"anyOf": [prop, {"type": "null"}]}
            added.append(name)
    node["required"] = required
    if added:
        node[_NULL_ADDED] = added


def _allows_null(node: dict) -> bool:
    if "null" in _types(node) or None in node.get("enum", [1]) or \
            ("const" in node and node["const"] is None):
        return True
    return any(isinstance(o, dict) and _allows_null(o)
               for key in ("anyOf", "oneOf") for o in node.get(key, []))


def is_optional(prop: dict, name: str, parent: dict, defs: dict) -> bool:
    """Whether the property ``name`` of ``parent`` may be absent or null."""
    return name not in parent.get("required", []) or _allows_null(resolve(prop, defs))


def tidy_then(parse: Callable[[str], Any], gen: dict) -> Callable[[str], Any]:
    """A parser that tidies the generated JSON (:func:`tidy`) before ``parse``."""
    def parse_tidied(text: str) -> Any:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return parse(text)  # (the caller's parser reports it)
        return parse(json.dumps(tidy(value, gen), ensure_ascii=False))
    return parse_tidied


def tidy(value: Any, gen: dict) -> Any:
    """``value`` generated under ``gen`` (:func:`generation_schema`), with repeated items
    of its distinct lists and the nulls it added to optional fields taken out, and its
    plain strings stripped of surrounding whitespace."""
    return _tidy(value, gen, gen.get("$defs", {}))


def _tidy(value: Any, node: Any, defs: dict) -> Any:
    if not isinstance(node, dict):
        return value
    node = resolve(node, defs)
    options = [node] + [resolve(o, defs) for key in ("anyOf", "oneOf", "allOf")
                        for o in node.get(key, []) if isinstance(o, dict)]
    if isinstance(value, dict):
        for option in options:
            props = option.get("properties", {})
            _null_copies(value, props, defs)
            for name in option.get(_NULL_ADDED, []):
                if name in value and value[name] is None:
                    del value[name]
            for name in list(value):
                if name in props:
                    value[name] = _tidy(value[name], props[name], defs)
    elif isinstance(value, list):
        for option in options:
            if isinstance(option.get("items"), dict):
                value = [_tidy(item, option["items"], defs) for item in value]
                if option.get(DISTINCT) is True:
                    value = _distinct(value)
                break
    elif isinstance(value, str) and value.strip() and any(
            "string" in _types(o) and not any(k in o for k in _SHAPED) for o in options):
        value = value.strip()  # (a span of the text may end at a space: "ARM ")
    return value


def _null_copies(value: dict, props: dict, defs: dict) -> None:
    """Null each nullable string field of ``value`` that only copies another field's
    value (a required one, or an earlier one): a small model fills a field the text
    leaves empty with its neighbour's value ("venue": the event's title)."""
    _drop_copied_items(value, props)
    seen: dict[str, bool] = {}       # normalised string -> whether a required field has it
    for name, item in value.items():
        if isinstance(item, str) and name in props:
            key = " ".join(item.split()).casefold()
            seen[key] = seen.get(key, False) or not _allows_null(resolve(props[name], defs))
    kept: set[str] = set()
    for name, item in value.items():
        if not (isinstance(item, str) and name in props) or not item.strip():
            continue
        key = " ".join(item.split()).casefold()
        if _allows_null(resolve(props[name], defs)) and (seen[key] or key in kept):
            value[name] = None
        else:
            kept.add(key)


def _drop_copied_items(value: dict, props: dict) -> None:
    """Drop the string items of a list field of ``value`` that an earlier list field
    already holds ("cons" that repeat the "pros")."""
    earlier: set[str] = set()
    for name, items in value.items():
        if not (isinstance(items, list) and name in props):
            continue
        keys = [" ".join(i.split()).casefold() if isinstance(i, str) else None for i in items]
        value[name] = [i for i, k in zip(items, keys) if k is None or k not in earlier]
        earlier.update(k for k in keys if k is not None)


def _distinct(items: list) -> list:
    """``items`` without the items equal to an earlier one (first occurrences kept)."""
    seen: set[str] = set()
    kept = []
    for item in items:
        key = json.dumps(item, sort_keys=True)
        if key not in seen:
            seen.add(key)
            kept.append(item)
    return kept


def resolve(schema: dict, defs: dict) -> dict:
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        return defs.get(ref.split("/")[-1], schema)
    return schema


