"""``$ref`` resolution: every reference of a schema becomes a root-relative JSON pointer.

Base URIs (``$id``, resolved against the enclosing one), anchors (``$anchor``,
``$dynamicAnchor``) and JSON-pointer fragments are resolved inside the one document;
a reference to any other document is a :class:`~formcast.ConstraintError` naming
it. Targets that are not the root or a direct ``$defs``/``definitions`` entry are
copied into ``$defs`` under a reserved name, so later rewrites that move schemas
(an ``allOf`` merged into its parent) cannot leave a pointer dangling.
"""

from __future__ import annotations

import copy
from typing import Any
from urllib.parse import unquote, urldefrag, urljoin

from formcast.grammars.errors import ConstraintError

_ROOT_URI = "https://formcast.invalid/root.json"
_ONE = ("additionalProperties", "items", "contains", "propertyNames", "not", "if", "then", "else",
        "unevaluatedItems", "unevaluatedProperties", "contentSchema")
_LIST = ("prefixItems", "anyOf", "oneOf", "allOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
HOISTED = "__formcast_ref"


def join(pointer: str, *parts: object) -> str:
    """Append JSON-pointer segments (escaping ``~`` and ``/``)."""
    for p in parts:
        pointer += "/" + str(p).replace("~", "~0").replace("/", "~1")
    return pointer


def children(node: dict, pointer: str) -> list[tuple[Any, str]]:
    """(subschema, pointer) for each schema directly inside ``node``."""
    out = []
    for kw in _ONE:
        if kw in node:
            out.append((node[kw], join(pointer, kw)))
    for kw in _LIST:
        for i, sub in enumerate(node.get(kw) or ()):
            out.append((sub, join(pointer, kw, i)))
    for kw in _MAP:
        for name, sub in (node.get(kw) or {}).items():
            out.append((sub, join(pointer, kw, name)))
    return out


def lookup(root: Any, pointer: str) -> Any:
    """The value at a root-relative pointer ``#/a/b``; KeyError if there is none."""
    node = root
    for raw in pointer[1:].split("/")[1:] if pointer != "#" else ():
        key = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            raise KeyError(pointer)
    return node


def resolve_refs(root: Any) -> Any:
    """A copy of ``root`` (2020-12 form) whose every ``$ref`` is ``#`` + a pointer to it.

    Raises
    ------
    ConstraintError
        For a reference to another document or one that does not resolve (with the
        JSON pointer of the ``$ref``).
    """
    root = copy.deepcopy(root)
    resources: dict[str, str] = {}            # base URI -> pointer of its schema
    anchors: dict[tuple[str, str], str] = {}  # (base URI, anchor) -> pointer
    refs: list[tuple[dict, str, str]] = []    # (node, base URI, pointer)
    dynamic: dict[str, int] = {}              # $dynamicAnchor name -> how many
    stack: list[tuple[Any, str, str]] = [(root, _ROOT_URI, "#")]
    while stack:
        node, base, pointer = stack.pop()
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("$id"), str):
            base = urldefrag(node["$id"] if ":" in node["$id"].split("/")[0]
                             else urljoin(base, node["$id"])).url
            resources.setdefault(base, pointer)
        if pointer == "#":
            resources.setdefault(base, pointer)
        for kw in ("$anchor", "$dynamicAnchor"):
            if isinstance(node.get(kw), str):
                anchors.setdefault((base, node[kw]), pointer)
        if isinstance(node.get("$dynamicAnchor"), str):
            dynamic[node["$dynamicAnchor"]] = dynamic.get(node["$dynamicAnchor"], 0) + 1
        if isinstance(node.get("$dynamicRef"), str) and "$ref" not in node:
            # With one anchor of its name, the dynamic scope has nothing else to find.
            node["$ref"] = node.pop("$dynamicRef")
            node["$dynamicRef"] = node["$ref"]
        if isinstance(node.get("$ref"), str):
            refs.append((node, base, pointer))
        stack.extend((sub, base, where) for sub, where in children(node, pointer))
    for node, base, pointer in refs:
        dynamic_ref = node.pop("$dynamicRef", None)
        if dynamic_ref is not None and dynamic.get(urldefrag(dynamic_ref).fragment, 0) > 1:
            raise ConstraintError(f"{join(pointer, '$dynamicRef')}: {dynamic_ref!r} may resolve "
                                  "to several $dynamicAnchor schemas; formcast resolves dynamic "
                                  "references only when the anchor name is unique")
        keyword = "$ref" if dynamic_ref is None else "$dynamicRef"
        node["$ref"] = _target(root, node["$ref"], base, pointer, resources, anchors, keyword)
    _hoist(root, [node for node, _, _ in refs])
    return root


def _target(root: Any, ref: str, base: str, pointer: str, resources: dict[str, str],
            anchors: dict[tuple[str, str], str], keyword: str) -> str:
    where = join(pointer, keyword)
    uri, fragment = (base, ref[1:]) if ref.startswith("#") else urldefrag(urljoin(base, ref))
    fragment = unquote(fragment)
    if uri not in resources:
        raise ConstraintError(f"{where}: {ref!r} is not local: it refers to another document; "
                              "only references inside the schema are supported (inline it, or "
                              "add it under $defs with a matching $id)")
    start = resources[uri]
    if fragment and not fragment.startswith("/"):
        if (uri, fragment) not in anchors:
            raise ConstraintError(f"{where}: {ref!r} does not resolve (no anchor {fragment!r})")
        return anchors[(uri, fragment)]
    target = start + fragment if start != "#" else "#" + fragment
    try:
        lookup(root, target)
    except KeyError:
        raise ConstraintError(f"{where}: {ref!r} does not resolve") from None
    return target


def _hoist(root: Any, nodes: list[dict]) -> None:
    """Copy targets that a rewrite could move into ``$defs`` (see the module docstring)."""
    if not isinstance(root, dict):
        return
    moved: dict[str, str] = {}
    for node in nodes:
        target = node["$ref"]
        parts = target.split("/")
        if target == "#" or (len(parts) == 3 and parts[1] in ("$defs", "definitions")):
            continue
        if target not in moved:
            moved[target] = f"#/$defs/{HOISTED}{len(moved)}"
    if not moved:
        return
    copies = {name: copy.deepcopy(lookup(root, target)) for target, name in moved.items()}
    defs = root.setdefault("$defs", {})
    for target, name in moved.items():
        defs[name.rsplit("/", 1)[1]] = copies[name]
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str) and node["$ref"] in moved:
                node["$ref"] = moved[node["$ref"]]
            stack.extend(sub for sub, _ in children(node, "#"))
