"""formcast's extraction prompt and constraint as they were before issue 65, frozen.

A copy of ``formcast.extraction``'s ``extraction_messages`` (the JSON form to fill,
``"name": <type>, // description`` per field, then the text) and ``cap_free_strings``
(free strings capped at 64 characters for generation) as of 2026-12-07, so the
extraction benchmark can hold new prompts against the old one in the same run after
the SDK's own prompt has moved on. Only the benchmark uses it.
"""

from __future__ import annotations

import copy
import json
from typing import Any

MAX_FREE_STRING = 64  # characters, the cap generation used then
_MAX_DEPTH = 3  # nested objects written out in the form; deeper ones are named only


def previous_messages(text: str, json_schema: dict) -> list[dict[str, str]]:
    """The chat messages the previous ``extract`` sent for ``text`` (one user turn)."""
    form = "\n".join(_form_lines(json_schema, json_schema.get("$defs", {})))
    content = f"Extract the information as JSON in this form:\n{form}\n\nText: {text.strip()}"
    return [{"role": "user", "content": content}]


def previous_constraint(json_schema: dict) -> dict:
    """The JSON Schema the previous ``extract`` generated under: a copy of
    ``json_schema`` whose free strings (no maxLength, enum, const, pattern or format)
    get ``maxLength: 64``."""
    capped = copy.deepcopy(json_schema)
    _cap(capped)
    return capped


def _cap(node: Any) -> None:
    if isinstance(node, list):
        for item in node:
            _cap(item)
        return
    if not isinstance(node, dict):
        return
    types = node.get("type")
    is_string = types == "string" or (isinstance(types, list) and "string" in types)
    if is_string and not any(k in node for k in ("maxLength", "enum", "const", "pattern",
                                                   "format")):
        node["maxLength"] = max(MAX_FREE_STRING, node.get("minLength", 0))
    for key, value in node.items():
        if key not in ("enum", "const", "default", "examples"):
            _cap(value)


def _form_lines(schema: dict, defs: dict, indent: str = "", depth: int = 0) -> list[str]:
    schema = _resolve(schema, defs)
    props = list(schema.get("properties", {}).items())
    if not props:
        return [indent + f"<{_type_name(schema, defs)}>"]
    lines = [indent + "{"]
    inner = indent + "  "
    for n, (name, prop) in enumerate(props):
        comma = "," if n < len(props) - 1 else ""
        prop_r = _resolve(prop, defs)
        nested = _object_schema(prop_r, defs) if depth < _MAX_DEPTH else None
        if nested is None:
            desc = prop_r.get("description") or prop.get("description")
            note = f" // {' '.join(desc.split())}" if desc else ""
            lines.append(f'{inner}"{name}": <{_type_name(prop, defs)}>{comma}{note}')
            continue
        is_list = _is_list(prop_r, defs)
        body = _form_lines(nested, defs, inner + ("  " if is_list else ""), depth + 1)
        if is_list:
            lines += [f'{inner}"{name}": [', *body, f"{inner}]{comma}"]
        else:
            lines += [f'{inner}"{name}": ' + body[0].lstrip(), *body[1:-1], body[-1] + comma]
    lines.append(indent + "}")
    return lines


def _is_list(prop: dict, defs: dict) -> bool:
    if prop.get("type") == "array":
        return True
    return any(_resolve(o, defs).get("type") == "array"
               for key in ("anyOf", "oneOf") for o in prop.get(key, []))


def _type_name(prop: dict, defs: dict) -> str:
    prop = _resolve(prop, defs)
    if "enum" in prop:
        return "one of " + ", ".join(json.dumps(v) for v in prop["enum"])
    if "const" in prop:
        return f"exactly {json.dumps(prop['const'])}"
    for key in ("anyOf", "oneOf"):
        if key in prop:
            return " or ".join(dict.fromkeys(_type_name(p, defs) for p in prop[key]))
    t = prop.get("type", "any")
    if isinstance(t, list):
        return " or ".join(t)
    if t == "array":
        return f"list of {_type_name(prop.get('items', {}), defs)}"
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
