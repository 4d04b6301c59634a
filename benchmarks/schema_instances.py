"""Valid and invalid instances of a schema, with jsonschema as the oracle (cached on disk).

Valid instances come from ``hypothesis-jsonschema`` under a per-schema budget and
time limit; invalid ones are mutations of the valid ones (a key dropped, a value of
the wrong type, a number out of range, an extra property, a string too long, ...)
that the oracle -- jsonschema's validator for the schema's own ``$schema`` (default
2020-12), without format assertion, reading OpenAPI 3.0's ``nullable`` where the
schema is OpenAPI's -- says are invalid. Each invalid instance carries the oracle's
first error: its keyword and the instance path.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
import signal
import warnings
from dataclasses import dataclass
from typing import Any

from schema_corpus import CorpusSchema, cache_dir
from token_protocol import compact

_RECIPE = "instances-v1"       # bump when generation changes: old cache entries are ignored


@dataclass(frozen=True)
class Instances:
    """The instances of one schema, or why none could be made (``skipped``)."""

    valid: list[Any]
    invalid: list[tuple[Any, str, str]]     # (instance, oracle keyword, instance path)
    skipped: str = ""


class _OutOfTime(BaseException):
    """Raised by the alarm; a BaseException so that no library swallows it."""


def oracle(entry: CorpusSchema):
    """A jsonschema validator for ``entry`` (its draft; OpenAPI 3.0's nullable)."""
    from jsonschema import Draft202012Validator, validators

    base = validators.validator_for(entry.schema, default=Draft202012Validator)
    if entry.openapi30:
        checks = dict(base.VALIDATORS)
        plain_type = checks["type"]

        def nullable_type(validator, types, instance, schema):
            if instance is None and schema.get("nullable") is True:
                return
            yield from plain_type(validator, types, instance, schema)
        base = validators.extend(base, {"type": nullable_type})
    return base(entry.schema)


def _valid(entry: CorpusSchema, n: int, seconds: float, max_chars: int) -> list[Any]:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis_jsonschema import from_schema

    found: list[Any] = []
    seen: set[str] = set()

    def collect(x: Any) -> None:
        text = compact(x)
        if len(found) < n and len(text) <= max_chars and text not in seen:
            seen.add(text)
            found.append(x)

    def on_alarm(signum, frame):
        raise _OutOfTime

    previous = signal.signal(signal.SIGALRM, on_alarm)
    # the alarm covers from_schema too: it resolves and canonicalises eagerly
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run = settings(max_examples=4 * n, deadline=None, database=None, derandomize=True,
                           phases=[Phase.generate], suppress_health_check=list(HealthCheck)
                           )(given(from_schema(entry.schema))(collect))
            run()
    except _OutOfTime:
        if not found:
            raise TimeoutError(f"no instance in {seconds:g} s") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return found


def _nodes(value: Any, path: tuple = ()) -> list[tuple[tuple, Any]]:
    out = [(path, value)]
    if isinstance(value, dict):
        for k, v in value.items():
            out.extend(_nodes(v, (*path, k)))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out.extend(_nodes(v, (*path, i)))
    return out


def _replaced(root: Any, path: tuple, new: Any) -> Any:
    if not path:
        return new
    out = copy.deepcopy(root)
    node = out
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = new
    return out


def mutations(instance: Any) -> list[Any]:
    """Candidate invalid instances made from a valid one (the oracle picks the invalid)."""
    out: list[Any] = []
    for path, value in _nodes(instance):
        if isinstance(value, dict):
            for key in list(value)[:4]:
                out.append(_replaced(instance, path, {k: v for k, v in value.items() if k != key}))
            out.append(_replaced(instance, path, {**value, "zz_extra_property": 0}))
            out.append(_replaced(instance, path, []))
        elif isinstance(value, list):
            out.append(_replaced(instance, path, []))
            if value:
                out.append(_replaced(instance, path, [*value, value[-1]]))
            out.append(_replaced(instance, path, [*value, {"zz": [1]}]))
            out.append(_replaced(instance, path, {}))
        elif isinstance(value, bool):
            out.append(_replaced(instance, path, "true"))
        elif isinstance(value, (int, float)):
            out.extend(_replaced(instance, path, new) for new in ("0", 10 ** 12, -10 ** 12, 0.5))
        elif isinstance(value, str):
            out.extend(_replaced(instance, path, new)
                       for new in (12345, "", value + "z" * 300, "zz-not-allowed", None))
        else:   # null
            out.append(_replaced(instance, path, 0))
    return out


def _invalid(entry: CorpusSchema, valid: list[Any], n: int, validator) -> list[tuple]:
    rng = random.Random(compact(entry.schema)[:200] + entry.name)
    candidates = [m for v in valid for m in mutations(v)]
    rng.shuffle(candidates)
    out, seen = [], set()
    for candidate in candidates[:400]:
        text = compact(candidate)
        if text in seen:
            continue
        seen.add(text)
        error = next(iter(validator.iter_errors(candidate)), None)
        if error is not None:
            out.append((candidate, str(error.validator), error.json_path))
            if len(out) >= n:
                break
    return out


def instances(entry: CorpusSchema, *, n_valid: int, n_invalid: int, seconds: float,
              max_chars: int = 1500) -> Instances:
    """Valid and invalid instances of ``entry``, generated once and cached."""
    key = hashlib.sha256(json.dumps([_RECIPE, entry.schema, entry.openapi30, n_valid,
                                     n_invalid, seconds, max_chars],
                                    sort_keys=True).encode()).hexdigest()[:24]
    path = cache_dir() / "instances" / f"{key}.json"
    if path.exists():
        data = json.loads(path.read_text())
        return Instances(data["valid"], [tuple(x) for x in data["invalid"]], data["skipped"])
    found = _generate(entry, n_valid, n_invalid, seconds, max_chars)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"valid": found.valid, "invalid": found.invalid,
                                "skipped": found.skipped}))
    return found


def _generate(entry: CorpusSchema, n_valid: int, n_invalid: int, seconds: float,
              max_chars: int) -> Instances:
    try:
        validator = oracle(entry)
    except Exception as exc:
        return Instances([], [], f"oracle: {type(exc).__name__}")
    try:
        valid = _valid(entry, n_valid, seconds, max_chars)
    except Exception as exc:  # whatever hypothesis-jsonschema cannot handle
        return Instances([], [], f"generator: {type(exc).__name__}: {str(exc)[:120]}")
    try:
        valid = [v for v in valid if validator.is_valid(v)]
    except Exception as exc:
        return Instances([], [], f"oracle: {type(exc).__name__}: {str(exc)[:120]}")
    if not valid:
        return Instances([], [], "generator: no instance within the budget")
    return Instances(valid, _invalid(entry, valid, n_invalid, validator))


# --- where a rejection happened: the instance path at a text offset, the schema there

ASSERTIONS = frozenset({
    "type", "enum", "const", "format", "pattern", "minLength", "maxLength", "minimum",
    "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "required",
    "properties", "patternProperties", "additionalProperties", "propertyNames",
    "minProperties", "maxProperties", "dependentRequired", "dependentSchemas",
    "dependencies", "items", "prefixItems", "additionalItems", "contains", "minItems",
    "maxItems", "uniqueItems", "allOf", "anyOf", "oneOf", "not", "if", "$ref",
    "unevaluatedProperties", "unevaluatedItems", "nullable"})


def path_at(text: str, offset: int) -> tuple:
    """The instance path (keys and indices) of the value being written at ``offset``
    of compact JSON ``text`` (while a key is written: the object's path)."""
    stack: list[list] = []          # [container kind, current key or index]
    i, in_string, key_mode = 0, False, False
    string_start = 0
    while i < min(offset, len(text)):
        c = text[i]
        if in_string:
            if c == "\\":
                i += 1
            elif c == '"':
                in_string = False
                if key_mode and stack:
                    stack[-1][1] = json.loads(text[string_start:i + 1])
        elif c == '"':
            in_string, string_start = True, i
            key_mode = bool(stack) and stack[-1][0] == "{" and text[i - 1] in "{,"
            if key_mode:
                stack[-1][1] = None      # a key in progress: the object's own place
        elif c in "{[":
            stack.append([c, 0 if c == "[" else None])
        elif c in "}]":
            stack.pop()
        elif c == "," and stack and stack[-1][0] == "[":
            stack[-1][1] += 1
        i += 1
    return tuple(step for _, step in stack if step is not None)


def _expand(nodes: list, root: Any) -> list[dict]:
    """``nodes`` and the subschemas they bring in by $ref and the applicators, in
    document order (a node before its $ref target, allOf's branches in order)."""
    out, stack, seen = [], list(reversed(nodes)), set()
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        out.append(node)
        more: list = []
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            target: Any = root
            for part in ref[1:].split("/")[1:]:
                part = part.replace("~1", "/").replace("~0", "~")
                target = target.get(part) if isinstance(target, dict) else None
            more.append(target)
        for key in ("allOf", "anyOf", "oneOf"):
            more.extend(node.get(key) or [])
        more.extend(node.get(k) for k in ("then", "else") if k in node)
        stack.extend(reversed(more))
    return out


def _step(nodes: list[dict], step: str | int, root: Any) -> list[dict]:
    """The subschemas that apply to member ``step`` of a value ``nodes`` apply to."""
    import re

    nxt: list = []
    for node in nodes:
        if isinstance(step, str):
            props = node.get("properties") or {}
            if step in props:
                nxt.append(props[step])
                continue
            for pattern, sub in (node.get("patternProperties") or {}).items():
                try:
                    if re.search(pattern, step):
                        nxt.append(sub)
                except re.error:
                    pass
            if isinstance(node.get("additionalProperties"), dict):
                nxt.append(node["additionalProperties"])
        else:
            items = node.get("items")
            prefix = node.get("prefixItems") or (items if isinstance(items, list) else [])
            if step < len(prefix):
                nxt.append(prefix[step])
            elif isinstance(items, dict):
                nxt.append(items)
            elif isinstance(node.get("additionalItems"), dict):
                nxt.append(node["additionalItems"])
    return _expand(nxt, root)


def keywords_at(schema: Any, path: tuple) -> set[str]:
    """The assertion keywords of the subschemas that can apply at ``path``."""
    nodes = _expand([schema], schema)
    for step in path:
        nodes = _step(nodes, step, schema)
    return {k for node in nodes for k in node if k in ASSERTIONS}


def in_schema_order(instance: Any, schema: Any, *, closed: bool = False) -> Any:
    """``instance`` with each object's keys in the order its schema declares them
    (declared ones first, the rest after, as they were). The systems under test
    write properties in the schema's order; JSON objects are unordered, so this
    is the same instance for the oracle. ``closed``: keys an object's schema does
    not declare are dropped where it declares some (the caller re-checks the result)."""
    def walk(value: Any, nodes: list[dict]) -> Any:
        if isinstance(value, dict):
            declared = [k for node in nodes for k in (node.get("properties") or {})]
            order = list(dict.fromkeys([k for k in declared if k in value] + list(value)))
            if closed and declared:
                order = [k for k in order if k in declared]
            return {k: walk(value[k], _step(nodes, k, schema)) for k in order}
        if isinstance(value, list):
            return [walk(v, _step(nodes, i, schema)) for i, v in enumerate(value)]
        return value
    return walk(instance, _expand([schema], schema))
