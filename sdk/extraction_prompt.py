"""The extraction prompt: the JSON form to fill, then the text.

The prompt is one user turn: the JSON form to fill, each field written as
``"name": <type>, // description`` (nested objects and lists of objects shown in
place; an optional field says it may be null), then the text. Measured on
``benchmarks/extraction_quality.py`` this form beats a system prompt with a
bulleted field list by several points of field accuracy on SmolLM2-135M: small
models copy a JSON skeleton far better than they follow prose rules. The grammar
guarantees the shape; the prompt makes the values right.
"""

from __future__ import annotations

import json

from formcast.extraction_schema import is_optional, resolve

ABSENT_NOTE = "null if the text does not say"  # the form's note on an optional field
_MAX_DEPTH = 3  # nested objects shown in the form; deeper ones are named only


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
    schema = resolve(schema, defs)
    props = list(schema.get("properties", {}).items())
    if not props:
        return [indent + f"<{type_name(schema, defs)}>"]
    lines = [indent + "{"]
    inner = indent + "  "
    for n, (name, prop) in enumerate(props):
        comma = "," if n < len(props) - 1 else ""
        prop_r = resolve(prop, defs)
        nested = _object_schema(prop_r, defs) if depth < _MAX_DEPTH else None
        if nested is None:
            desc = prop_r.get("description") or prop.get("description")
            notes = [" ".join(desc.split())] if desc else []
            kind = type_name(prop, defs)
            if is_optional(prop, name, schema, defs):
                kind += "" if kind.endswith(" or null") else " or null"
                notes.append(ABSENT_NOTE)
            note = f" // {'; '.join(notes)}" if notes else ""
            lines.append(f'{inner}"{name}": <{kind}>{comma}{note}')
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
    return any(resolve(o, defs).get("type") == "array"
               for key in ("anyOf", "oneOf") for o in prop.get(key, []))


def type_name(prop: dict, defs: dict) -> str:
    prop = resolve(prop, defs)
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


def _object_schema(prop: dict, defs: dict) -> dict | None:
    if prop.get("type") == "object" and "properties" in prop:
        return prop
    if prop.get("type") == "array":
        items = resolve(prop.get("items", {}), defs)
        if items.get("type") == "object" and "properties" in items:
            return items
    for key in ("anyOf", "oneOf"):
        for option in prop.get(key, []):
            option = resolve(option, defs)
            if option.get("type") == "object" and "properties" in option:
                return option
    return None
