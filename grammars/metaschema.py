"""The metaschema check of a JSON Schema, with the 2019-09 and 2020-12 metaschemas flattened.

The metaschemas of drafts 2019-09 and 2020-12 are a root that ``allOf``-references
one schema per vocabulary, recursing through ``$recursiveRef``/``$dynamicRef``.
jsonschema resolves those references dynamically at every node of the checked
schema, which makes ``check_schema`` cost seconds on a large schema (tens of
milliseconds for the same schema under draft 7's plain metaschema). Merging the
vocabularies into one document and pointing every dynamic reference at its root
gives the same verdicts (the dynamic scope only changes when a metaschema extends
another) at the cost of a plain ``$ref``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import jsonschema
from jsonschema.exceptions import SchemaError
from jsonschema_specifications import REGISTRY

_FLATTENED = {
    jsonschema.Draft202012Validator: "https://json-schema.org/draft/2020-12/schema",
    jsonschema.Draft201909Validator: "https://json-schema.org/draft/2019-09/schema",
}


def check_schema(schema: Any, validator: type) -> None:
    """Raise jsonschema's ``SchemaError`` where ``schema`` breaks its draft's metaschema.

    Parameters
    ----------
    schema : Any
        The parsed schema.
    validator : type
        The jsonschema validator class of the schema's draft.
    """
    if validator not in _FLATTENED:
        validator.check_schema(schema)      # drafts 4-7: a plain metaschema, already fast
        return
    for error in _checker(validator).iter_errors(schema):
        raise SchemaError.create_from(error)


@lru_cache(maxsize=None)
def _checker(validator: type) -> Any:
    return validator(flattened(_FLATTENED[validator]), format_checker=validator.FORMAT_CHECKER)


@lru_cache(maxsize=None)
def flattened(uri: str) -> dict:
    """The metaschema at ``uri`` as one document with static references only."""
    root = REGISTRY.contents(uri)
    base = uri.rsplit("/", 1)[0] + "/"
    parts = [root] + [REGISTRY.contents(base + part["$ref"]) for part in root.get("allOf", ())]
    flat: dict[str, Any] = {"type": ["object", "boolean"], "properties": {}, "$defs": {}}
    for part in parts:
        for section in ("properties", "$defs"):
            for name, sub in part.get(section, {}).items():
                if flat[section].get(name, sub) != sub:
                    raise AssertionError(f"metaschema {uri}: two vocabularies define {name}")
                flat[section][name] = sub
    return _static(flat)


def _static(node: Any) -> Any:
    if isinstance(node, list):
        return [_static(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in ("properties", "patternProperties", "$defs") and isinstance(value, dict):
            out[key] = {name: _static(sub) for name, sub in value.items()}   # names, not keywords
        elif key in ("$dynamicRef", "$recursiveRef"):
            out["$ref"] = "#"               # every dynamic reference names the metaschema itself
        elif key == "$ref" and isinstance(value, str):
            out["$ref"] = "#" + value.partition("#")[2]   # "meta/validation#/$defs/x" -> "#/$defs/x"
        elif key in ("$dynamicAnchor", "$recursiveAnchor", "$id", "$schema", "$vocabulary"):
            continue
        else:
            out[key] = _static(value)
    return out
