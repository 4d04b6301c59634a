"""Typed extraction: the prompt that shows the model what to fill, and the spec.

The prompt is one user turn: the JSON form to fill, each field written as
``"name": <type>, // description`` (nested objects and lists of objects shown in
place), then the text. Measured on ``benchmarks/extraction_quality.py`` this form
beats a system prompt with a bulleted field list by several points of field
accuracy on SmolLM2-135M: small models copy a JSON skeleton far better than they
follow prose rules. The grammar guarantees the shape; the prompt makes the values
right.

Generation also caps free strings (no ``maxLength``, ``enum``, ``const``,
``pattern`` or ``format``) at :data:`MAX_FREE_STRING` characters, so a small model
cannot run a field on until ``max_tokens``; the output is still validated against
the caller's own schema.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any, is_typeddict

from formcast.grammars.errors import UnsupportedTypeError
from formcast.spec import OutputSpec, parse_json, type_spec

MAX_FREE_STRING = 64  # characters, for generation only; see the module docstring
_MAX_DEPTH = 3  # nested objects shown in the form; deeper ones are named only


def extraction_spec(schema: Any) -> OutputSpec:
    """Spec for ``extract``: a JSON Schema dict (returns dicts) or a class (instances).

    The constraint is compiled from a copy of the schema with free strings capped
    (:func:`cap_free_strings`); the parser validates against the schema as given.
    """
    from formcast import grammars

    if isinstance(schema, dict):
        spec = OutputSpec(kind="json", parser=lambda text: parse_json(text, schema),
                          json_schema=schema)
    else:
        is_model = hasattr(schema, "model_json_schema")
        if not (is_model or dataclasses.is_dataclass(schema) or is_typeddict(schema)):
            raise UnsupportedTypeError(f"extract() takes a pydantic model, dataclass, TypedDict or JSON "
                            f"Schema dict, got {schema!r}")
        spec = type_spec(schema)
    return dataclasses.replace(
        spec, constraint=grammars.JsonSchema(cap_free_strings(spec.json_schema)))


def cap_free_strings(schema: dict, limit: int = MAX_FREE_STRING) -> dict:
    """A copy of ``schema`` where every string without its own length, value or
    shape bound gets ``maxLength: limit``."""
    capped = copy.deepcopy(schema)
    _cap(capped, limit)
    return capped


def _cap(node: Any, limit: int) -> None:
    if isinstance(node, list):
        for item in node:
            _cap(item, limit)
        return
    if not isinstance(node, dict):
        return
    types = node.get("type")
    is_string = types == "string" or (isinstance(types, list) and "string" in types)
    if is_string and not any(k in node for k in ("maxLength", "enum", "const", "pattern",
                                                   "format")):
        node["maxLength"] = max(limit, node.get("minLength", 0))
    for key, value in node.items():
        if key not in ("enum", "const", "default", "examples"):
            _cap(value, limit)


def extraction_messages(text: str, json_schema: dict, *, instructions: str | None = None
                        ) -> list[dict[str, str]]:
    """Chat messages asking the model to extract ``json_schema``'s fields from ``text``."""
    defs = json_schema.get("$defs", {})
    parts = ["Extract the information as JSON in this form:\n"
             + "\n".join(form_lines(json_schema, defs))]
    if instructions:
        parts.append(instructions.strip())
    parts.append(f"Text: {text.strip()}")
    return [{"role": "user", "content": "\n\n".join(parts)}]


def form_lines(schema: dict, defs: dict, indent: str = "", depth: int = 0) -> list[str]:
    """The JSON form of an object schema: ``"name": <type>, // description`` per property,
    nested objects and lists of objects written out in place."""
    schema = _resolve(schema, defs)
    props = list(schema.get("properties", {}).items())
    if not props:
        return [indent + f"<{type_name(schema, defs)}>"]
    lines = [indent + "{"]
    inner = indent + "  "
    for n, (name, prop) in enumerate(props):
        comma = "," if n < len(props) - 1 else ""
        prop_r = _resolve(prop, defs)
        nested = _object_schema(prop_r, defs) if depth < _MAX_DEPTH else None
        if nested is None:
            desc = prop_r.get("description") or prop.get("description")
            note = f" // {' '.join(desc.split())}" if desc else ""
            lines.append(f'{inner}"{name}": <{type_name(prop, defs)}>{comma}{note}')
            continue
        body = form_lines(nested, defs, inner + ("  " if _is_list(prop_r, defs) else ""),
                          depth + 1)
        if _is_list(prop_r, defs):
            lines.append(f'{inner}"{name}": [')
            lines.extend(body)
            lines.append(f"{inner}]{comma}")
        else:
            lines.append(f'{inner}"{name}": ' + body[0].lstrip())
            lines.extend(body[1:-1])
            lines.append(body[-1] + comma)
    lines.append(indent + "}")
    return lines


def _is_list(prop: dict, defs: dict) -> bool:
    if prop.get("type") == "array":
        return True
    return any(_resolve(o, defs).get("type") == "array"
               for key in ("anyOf", "oneOf") for o in prop.get(key, []))


def type_name(prop: dict, defs: dict) -> str:
    prop = _resolve(prop, defs)
    if "enum" in prop:
        return "one of " + ", ".join(json.dumps(v) for v in prop["enum"])
    if "const" in prop:
        return f"exactly {json.dumps(prop['const'])}"
    for key in ("anyOf", "oneOf"):
        if key in prop:
            names = [type_name(p, defs) for p in prop[key]]
            return " or ".join(dict.fromkeys(names))
    t = prop.get("type", "any")
    if isinstance(t, list):
        return " or ".join(t)
    if t == "array":
        return f"list of {type_name(prop.get('items', {}), defs)}"
    if t == "object" and prop.get("title"):
        return f"object {prop['title']}"
    if t == "string" and prop.get("format"):
        return f"string, format {prop['format']}"
    return t


def _resolve(schema: dict, defs: dict) -> dict:
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        return defs.get(ref.split("/")[-1], schema)
    return schema


def _object_schema(prop: dict, defs: dict) -> dict | None:
    if prop.get("type") == "object" and "properties" in prop:
        return prop
    if prop.get("type") == "array":
        items = _resolve(prop.get("items", {}), defs)
        if items.get("type") == "object" and "properties" in items:
            return items
    for key in ("anyOf", "oneOf"):
        for option in prop.get(key, []):
            option = _resolve(option, defs)
            if option.get("type") == "object" and "properties" in option:
                return option
    return None
