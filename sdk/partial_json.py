"""Parse a JSON document that is still being written.

``parse_partial('{"name": "Ad')`` gives ``{"name": "Ad"}``: open strings, arrays and
objects are closed, a key whose value has not started yet is dropped, and a number
or literal cut in the middle is left out until it is complete. Used to stream
partial objects out of constrained JSON generation.
"""

from __future__ import annotations

import json
from typing import Any

_MISSING = object()


def parse_partial(text: str) -> Any:
    """Best-effort value of a JSON prefix; None when nothing is usable yet."""
    completed = complete_prefix(text)
    if completed is None:
        return None
    try:
        return json.loads(completed)
    except json.JSONDecodeError:
        return None


def complete_prefix(text: str) -> str | None:
    """Close a JSON prefix into a parseable document (or None if nothing is usable)."""
    stack: list[str] = []       # open containers: "{" or "["
    out: list[str] = []
    i, n = 0, len(text)
    # per open object: whether we are before a key, after a key (awaiting value), or in value
    safe = 0                    # length of `out` content that is a consistent prefix
    expecting_key = False
    while i < n:
        c = text[i]
        if c == '"':
            j = i + 1
            while j < n:
                if text[j] == "\\":
                    j += 2
                    continue
                if text[j] == '"':
                    break
                j += 1
            if j >= n:  # unterminated string
                if expecting_key:
                    break
                body = text[i:n]
                if body.endswith("\\") and not body.endswith("\\\\"):
                    body = body[:-1]
                body = _trim_partial_escape(body)
                out.append(body + '"')
                safe = len(out)
                i = n
                break
            token = text[i:j + 1]
            out.append(token)
            i = j + 1
            if expecting_key:
                # a key: only safe once its value starts
                expecting_key = False
            else:
                safe = len(out)
            continue
        if c in "{[":
            stack.append(c)
            out.append(c)
            expecting_key = c == "{"
            safe = len(out)
        elif c in "}]":
            if stack:
                stack.pop()
            out.append(c)
            expecting_key = False
            safe = len(out)
        elif c == ",":
            out.append(c)
            expecting_key = bool(stack) and stack[-1] == "{"
        elif c == ":":
            out.append(c)
        elif c in " \t\r\n":
            pass
        else:  # number or literal
            j = i
            while j < n and text[j] not in ",}] \t\r\n":
                j += 1
            token = text[i:j]
            if j >= n:  # may still grow: only keep complete literals
                if token in ("true", "false", "null"):
                    out.append(token)
                    safe = len(out)
                i = n
                break
            out.append(token)
            safe = len(out)
            i = j
            continue
        i += 1
    body = out[:safe]
    # drop a dangling separator or an unfinished key (key with no value yet)
    while body and body[-1] in (",", ":"):
        if body[-1] == ":":
            body.pop()
            if body:
                body.pop()  # the key
        else:
            body.pop()
    # re-count open containers over what we keep
    opens: list[str] = []
    for tok in body:
        if tok in ("{", "["):
            opens.append(tok)
        elif tok in ("}", "]") and opens:
            opens.pop()
    if not body:
        return None
    # an object ending in a key without value was handled; a key then "," cannot happen
    return "".join(body) + "".join("}" if o == "{" else "]" for o in reversed(opens))


def _trim_partial_escape(body: str) -> str:
    # a cut \uXXXX escape cannot be parsed: drop it until complete
    k = body.rfind("\\u")
    if k != -1 and len(body) - k < 6 and (k == 0 or body[k - 1] != "\\"):
        return body[:k]
    return body
