"""Rewrite a resolved draft-2020-12 schema into the form a mask backend compiles.

The backend reads one applicator per schema (``$ref``, ``anyOf``, ``enum`` or
``type`` win over their siblings), so the rewrite folds siblings in: ``allOf``
and a ``$ref`` with siblings are merged into their parent, the parent's keywords
are distributed over its ``anyOf`` branches, an ``enum``/``const`` keeps only
the values the rest of its schema accepts, and a schema whose keywords apply to
some types only gets an explicit ``type`` list (the backend applies each keyword
to its type). Where the rewrite cannot keep the meaning it widens the mask and
records the keyword in ``lossy``: the end check then decides.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from formcast.grammars import regex_dialect
from formcast.grammars.schema_coverage import BackendProfile
from formcast.grammars.schema_merge import DROPPED, is_whole, literal, merge, same, widened
from formcast.grammars.schema_refs import join, lookup
from formcast.grammars.schema_satisfiable import Inhabitation, is_trivial

BY_TYPE = {
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "string": ("minLength", "maxLength", "pattern", "format"),
    "array": ("items", "prefixItems", "minItems", "maxItems", "uniqueItems", "contains",
              "minContains", "maxContains", "unevaluatedItems"),
    "object": ("properties", "required", "additionalProperties", "patternProperties",
               "minProperties", "maxProperties", "propertyNames", "dependentRequired",
               "dependentSchemas", "unevaluatedProperties"),
}
ALL_TYPES = ["null", "boolean", "number", "string", "array", "object"]
_ESCAPED = re.compile(r'["\\\x00-\x1f\x7f]')    # characters JSON writes as escapes
_RANGE = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")


@dataclass
class Rewriter:
    """One rewrite of one resolved schema for one backend profile."""

    root: Any
    analysis: Inhabitation
    strict: bool
    profile: BackendProfile
    lossy: dict[tuple[str, str], str] = field(default_factory=dict)
    _validator: Any = None                # validates enum values in the root's context

    def run(self) -> Any:
        """The rewritten schema (new objects; the root is not changed)."""
        return self.node(self.root, "#")

    def widen(self, pointer: str, kw: str, note: str) -> None:
        """Record that the mask admits more than ``kw`` allows; the end check decides."""
        self.lossy.setdefault((pointer, kw), note)

    def node(self, node: Any, pointer: str) -> Any:
        if node is True:
            node = {}                           # the backend reads {} in every place
        if not isinstance(node, dict):
            return node
        if self.profile.name == "outlines-core" and pointer != "#" and is_trivial(node):
            # outlines-core emits the any-value regex of `{}` ungrouped, so its alternatives
            # leak into the enclosing regex; as an anyOf branch it is grouped.
            return {"anyOf": [{}]}
        node = {k: v for k, v in node.items() if k not in DROPPED}
        if "$ref" in node and set(node) - {"$ref", "$defs", "definitions"}:
            ref = {"$ref": node.pop("$ref")}
            node["allOf"] = [ref, *node.get("allOf", [])]
        if "allOf" in node:
            merged = self.merge_all_of(node, pointer)
            if merged is None:
                self.widen(pointer, "allOf", "not merged into its parent: checked at the end")
                node.pop("allOf")
                widened(node)
            else:
                node = merged
        if "oneOf" in node:
            self.widen(pointer, "oneOf", "masked as anyOf; 'exactly one' is checked at the end")
            node["anyOf"] = node.pop("oneOf") if "anyOf" not in node else node["anyOf"]
        if "anyOf" in node:
            return self.any_of(node, pointer)
        if "enum" in node or "const" in node:
            return self.values(node, pointer)
        if "$ref" in node:
            return {k: v for k, v in node.items() if k in ("$ref", "$defs", "definitions")} | (
                {k: self.defs(node[k], join(pointer, k)) for k in ("$defs", "definitions")
                 if k in node})
        return self.typed(node, pointer)

    def defs(self, defs: dict, pointer: str) -> dict:
        return {name: self.node(s, join(pointer, name)) if self.analysis.types(s) or s is True
                else {} for name, s in defs.items()}

    def any_of(self, node: dict, pointer: str) -> Any:
        """``{A, anyOf: [B...]}`` -> ``{anyOf: [A and B...]}`` without empty branches."""
        rest = {k: v for k, v in node.items() if k not in ("anyOf", "$defs", "definitions")}
        branches = []
        for i, branch in enumerate(node["anyOf"]):
            if branch is False or not (branch is True or self.analysis.types(branch)):
                continue
            where = join(pointer, "anyOf", i)
            if is_trivial(rest):
                branches.append(self.node(branch, where))
                continue
            merged = self.merge_all_of({"allOf": [rest, branch]}, pointer)
            if merged is None:
                self.widen(pointer, "anyOf", "its siblings are checked at the end")
                merged = widened(dict(branch)) if isinstance(branch, dict) else branch
            branches.append(self.node(merged, where))
        if not branches:      # only where the analysis could not see it: stay sound
            self.widen(pointer, "anyOf", "no branch could be masked: checked at the end")
        out: dict[str, Any] = {"anyOf": branches or [{}]}
        for k in ("$defs", "definitions"):
            if k in node:
                out[k] = self.defs(node[k], join(pointer, k))
        return out

    def values(self, node: dict, pointer: str) -> dict:
        """An enum/const keeps only what the rest of its schema accepts (exact)."""
        values = node["enum"] if "enum" in node else [node["const"]]
        if "enum" in node and "const" in node:
            values = [v for v in values if same(v, node["const"])]
        rest = {k: v for k, v in node.items() if k not in ("enum", "const", "$defs",
                                                           "definitions")}
        if not is_trivial(rest):
            if self._validator is None:
                root = self.root if isinstance(self.root, dict) else {}
                self._validator = jsonschema.Draft202012Validator(
                    root, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
            check = self._validator.evolve(schema=rest)
            values = [v for v in values if check.is_valid(v)]
        out: dict[str, Any] = {"enum": values}
        numbers = self.profile.numeric_bounds
        tuples = self.profile.prefix_items_with_bounds
        shaped = [(tuples and isinstance(v, (dict, list))) or (numbers and is_whole(v))
                  for v in values]
        if any(shaped):
            # The backend writes enum literals compactly and numbers one way only; as
            # schemas, objects take whitespace and 1 may be written 1.0.
            plain = [v for v, s in zip(values, shaped) if not s]
            out = {"anyOf": [self.node(literal(v, numbers=numbers), pointer)
                             for v, s in zip(values, shaped) if s]
                   + ([{"enum": plain}] if plain else [])}
        for k in ("$defs", "definitions"):
            if k in node:
                out[k] = self.defs(node[k], join(pointer, k))
        return out

    def typed(self, node: dict, pointer: str) -> dict:
        """A schema without applicators: explicit types, per-type keywords, children."""
        for kw in _COUNTS:
            if isinstance(node.get(kw), float):
                node[kw] = int(node[kw])          # 2.0: metaschema-valid, a whole count
        if "type" not in node and any(kw in node for kws in BY_TYPE.values() for kw in kws):
            node["type"] = list(ALL_TYPES)
        types = node.get("type")
        types = set(types if isinstance(types, list) else [types] if types else [])
        self.drop_unenforced(node, types, pointer)
        if "integer" in types and "number" not in types:
            self.integer_bounds(node, pointer)
        if "pattern" in node:
            node["pattern"] = self.pattern(node["pattern"], pointer, "pattern")
        if "format" in node:
            if node["format"] not in self.profile.formats:
                del node["format"]
            else:
                node.pop("minLength", None)
                node.pop("maxLength", None)
        if "pattern" in node:
            node.pop("minLength", None)
            node.pop("maxLength", None)
        limit = self.profile.exact_length_limit
        if limit is not None and ("minLength" in node or "maxLength" in node) and max(
                node.get("minLength", 0), node.get("maxLength", 0)) <= limit:
            # The backend's own length bound admits raw control characters; a bounded
            # class does not (and stays small below the limit). Escapes stay out.
            low, high = node.pop("minLength", 0), node.pop("maxLength", "")
            node["pattern"] = regex_dialect.translate(f'^[^"\\\\\\x00-\\x1f]{{{low},{high}}}$')
        if "object" in types:
            self.object(node, pointer)
        if "array" in types:
            self.array(node, pointer)
        for k in ("$defs", "definitions"):
            if k in node:
                node[k] = self.defs(node[k], join(pointer, k))
        return node

    def drop_unenforced(self, node: dict, types: set[str], pointer: str) -> None:
        """Remove what the backend cannot compile exactly; the end check covers it."""
        p = self.profile
        drop = [kw for kw in node if kw not in p.mask and kw not in ("$defs", "definitions")]
        if not p.numeric_bounds:
            drop += ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"]
        if "multipleOf" in node and not (
                p.integer_multiple_of and types == {"integer"} and not any(
                    kw in node for kw in _RANGE) and float(node["multipleOf"]).is_integer()
                and node["multipleOf"] <= p.integer_multiple_limit):
            drop.append("multipleOf")        # the backend ignores it next to a range
        if not p.object_size:
            drop += ["minProperties", "maxProperties"]
        if "prefixItems" in node and not p.prefix_items_with_bounds:
            drop += ["prefixItems", "minItems", "maxItems"]
        for kw in drop:
            if node.pop(kw, None) is not None:
                self.widen(pointer, kw, f"{p.name} does not enforce it here")
        if "prefixItems" in drop and node.get("items") is False:
            node["items"] = True          # the items the prefix held must stay possible

    def pattern(self, pattern: str, pointer: str, kw: str) -> str:
        """A JSON Schema pattern (``re.search``) as a portable full-match regex (wider
        where the mask cannot follow it: recorded, the end check decides)."""
        found = regex_dialect.schema_pattern(pattern, where=join(pointer, kw))
        if not found.exact:
            self.widen(pointer, kw, found.note)
        return found.regex

    def integer_bounds(self, node: dict, pointer: str) -> None:
        """Integer-only bounds as inclusive whole numbers (the backend takes no others)."""
        for kw, fix in (("minimum", math.ceil), ("maximum", math.floor)):
            if kw in node:
                node[kw] = fix(node[kw])
        if "exclusiveMinimum" in node:
            low = math.floor(node.pop("exclusiveMinimum")) + 1
            node["minimum"] = max(node.get("minimum", low), low)
        if "exclusiveMaximum" in node:
            high = math.ceil(node.pop("exclusiveMaximum")) - 1
            node["maximum"] = min(node.get("maximum", high), high)

    def object(self, node: dict, pointer: str) -> None:
        props = node.get("properties")
        listed = props is not None
        patterns = node.get("patternProperties") or {}
        extra = node.get("additionalProperties")
        if props is not None:
            kept = {}
            for name, sub in props.items():
                if sub is False or not (sub is True or self.analysis.types(sub)):
                    if extra is not False or patterns:
                        self.widen(pointer, "properties", f"property {name!r} admits no value; "
                                                          "its absence is checked at the end")
                    continue
                if _ESCAPED.search(name):
                    self.widen(pointer, "properties", f"the name {name!r} needs escapes in JSON; "
                                                      "its value is checked at the end")
                kept[name] = self.node(sub, join(pointer, "properties", name))
            node["properties"] = props = kept
            listed = bool(kept)
        for name in node.get("required") or ():
            props = node.setdefault("properties", {}) if props is None else props
            if name not in props:
                matching = [s for p, s in patterns.items() if _search(p, name)]
                sub = matching[0] if matching else ({} if extra in (None, True) else extra)
                props[name] = self.node(sub, join(pointer, "required"))
        if patterns:
            node["patternProperties"] = {
                self.pattern(p, pointer, "patternProperties"):
                    self.node(s, join(pointer, "patternProperties", p))
                for p, s in patterns.items() if self.analysis.types(s)}
            if not node["patternProperties"]:
                del node["patternProperties"]
            self.widen(pointer, "patternProperties", "key patterns are masked; which schema "
                                                     "applies to a key is checked at the end")
        if isinstance(extra, dict):
            node["additionalProperties"] = self.node(extra, join(pointer, "additionalProperties"))
            if not self.analysis.types(extra):
                node["additionalProperties"] = False
        elif extra is None:
            # strict closes objects that list their properties; one that lists none is open.
            open_needed = node.get("minProperties", 0) > len(node.get("properties") or {})
            if not self.strict or open_needed or not listed:
                node["additionalProperties"] = True
        extra = node.get("additionalProperties", False)
        if "patternProperties" in node and extra is not False:
            # The backend mis-parses keys when a pattern and other keys compete; any key
            # then takes any of the schemas a key could have (wider: the end check decides).
            branches = list(node.pop("patternProperties").values())
            node["additionalProperties"] = {} if extra is True or {} in [extra, *branches] \
                else {"anyOf": [extra, *branches]}

    def array(self, node: dict, pointer: str) -> None:
        prefix = node.get("prefixItems")
        if prefix is not None:
            kept = []
            for i, sub in enumerate(prefix):
                if sub is False or not (sub is True or self.analysis.types(sub)):
                    node["maxItems"] = min(node.get("maxItems", i), i)
                    break
                kept.append(self.node(sub, join(pointer, "prefixItems", i)))
            node["prefixItems"] = kept
            if not kept:
                node.pop("prefixItems")
        items = node.get("items")
        if isinstance(items, dict):
            node["items"] = self.node(items, join(pointer, "items")) if self.analysis.types(
                items) else False
        elif items is None:
            node["items"] = True

    def merge_all_of(self, node: dict, pointer: str) -> dict | None:
        """``node`` with its ``allOf`` folded in, or None when that would change the meaning."""
        merged: dict | None = {k: v for k, v in node.items() if k != "allOf"}
        for i, branch in enumerate(node["allOf"]):
            if branch is True:
                continue
            if not isinstance(branch, dict):
                return None
            branch = {k: v for k, v in branch.items() if k not in DROPPED}
            seen: set[str] = set()
            while "$ref" in branch:
                ref = branch.pop("$ref")
                if ref in seen or ref == "#":
                    return None
                seen.add(ref)
                target = lookup(self.root, ref)
                if not isinstance(target, dict):
                    if target is True:
                        continue
                    return None
                target = {k: v for k, v in target.items() if k not in DROPPED}
                branch = merge(branch, target)
                if branch is None:
                    return None
            if "allOf" in branch:
                inner = self.merge_all_of(branch, join(pointer, "allOf", i))
                if inner is None:
                    return None
                branch = inner
            merged = merge(merged, branch)
            if merged is None:
                return None
        return merged


def _search(pattern: str, text: str) -> bool:
    try:
        return re.search(pattern, text) is not None
    except re.error:
        return False
