"""Typed extraction: the prompt that shows the model what to fill, and the spec.

The prompt lists every field with its type, whether it is required, its allowed
values and its description, and tells the model to copy values from the text and
use null for what the text does not say. The grammar guarantees the shape; the
prompt is what makes the values right.
"""

from __future__ import annotations

import dataclasses
from typing import Any, is_typeddict

from formcast.spec import OutputSpec, parse_json, type_spec

SYSTEM = (
    "You are a precise information extraction system. Read the text and return one JSON "
    "object with the fields listed below. Copy names, numbers, dates and other values "
    "exactly as they appear in the text. If the text does not state a value, use null "
    "where the field allows it; never invent information.")


def extraction_spec(schema: Any) -> OutputSpec:
    """Spec for ``extract``: a JSON Schema dict (returns dicts) or a class (instances)."""
    if isinstance(schema, dict):
        from formcast import grammars

        return OutputSpec(kind="json", constraint=grammars.JsonSchema(schema),
                          parser=lambda text: parse_json(text, schema), json_schema=schema)
    is_model = hasattr(schema, "model_json_schema")
    if not (is_model or dataclasses.is_dataclass(schema) or is_typeddict(schema)):
        raise TypeError(f"extract() takes a pydantic model, dataclass, TypedDict or JSON Schema "
                        f"dict, got {schema!r}")
    return type_spec(schema)


def extraction_messages(text: str, json_schema: dict, *, instructions: str | None = None
                        ) -> list[dict[str, str]]:
    """Chat messages asking the model to extract ``json_schema``'s fields from ``text``."""
    title = json_schema.get("title")
    lines = [SYSTEM, ""]
    if json_schema.get("description"):
        lines.append(f"The object{f' ({title})' if title else ''}: {json_schema['description']}")
    lines.append("Fields:")
    lines.extend(describe_fields(json_schema, json_schema.get("$defs", {})))
    user = []
    if instructions:
        user.append(instructions.strip())
    user.append(f'Text:\n"""\n{text.strip()}\n"""')
    user.append("Return the JSON object.")
    return [{"role": "system", "content": "\n".join(lines)},
            {"role": "user", "content": "\n\n".join(user)}]


def describe_fields(schema: dict, defs: dict, indent: str = "") -> list[str]:
    """One line per property: ``- name (type, required): description``, nested indented."""
    schema = _resolve(schema, defs)
    required = set(schema.get("required", []))
    lines = []
    for name, prop in schema.get("properties", {}).items():
        prop_r = _resolve(prop, defs)
        kind = type_name(prop, defs)
        need = "required" if name in required else "optional"
        desc = prop_r.get("description") or prop.get("description") or ""
        line = f"{indent}- {name} ({kind}, {need})"
        lines.append(line + (f": {desc}" if desc else ""))
        nested = _object_schema(prop_r, defs)
        if nested is not None and len(indent) < 8:
            lines.extend(describe_fields(nested, defs, indent + "  "))
    return lines


def type_name(prop: dict, defs: dict) -> str:
    prop = _resolve(prop, defs)
    if "enum" in prop:
        return "one of " + ", ".join(repr(v) for v in prop["enum"])
    if "const" in prop:
        return f"exactly {prop['const']!r}"
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
