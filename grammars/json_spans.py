"""Where a value sits in a JSON document, by its path (for rolling back to it)."""

from __future__ import annotations

import json
from collections.abc import Sequence

_DECODER = json.JSONDecoder()
_WS = " \t\n\r"


def value_span(text: str, path: Sequence[str | int]) -> tuple[int, int]:
    """Character span ``[start, end)`` of the value at ``path`` in the JSON ``text``.

    Does not change state. ``path`` holds object keys and array indices, as in a
    jsonschema error's ``absolute_path``.

    Raises
    ------
    ValueError
        If ``text`` is not JSON or has no value at ``path``.
    """
    i = _skip(text, 0)
    for step in path:
        i = _member(text, i, step)
    _, end = _DECODER.raw_decode(text, i)
    return i, end


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _member(text: str, i: int, step: str | int) -> int:
    """Start of the member ``step`` of the container starting at ``i``."""
    opener = text[i:i + 1]
    if opener not in ("{", "[") or (opener == "{") != isinstance(step, str):
        raise ValueError(f"no member {step!r} at offset {i}")
    i = _skip(text, i + 1)
    index = 0
    while i < len(text) and text[i] not in "}]":
        if opener == "{":
            key, i = json.decoder.scanstring(text, i + 1)
            i = _skip(text, _skip(text, i) + 1)          # past ':'
            hit = key == step
        else:
            hit = index == step
        if hit:
            return i
        _, i = _DECODER.raw_decode(text, i)
        i = _skip(text, i)
        if text[i:i + 1] == ",":
            i = _skip(text, i + 1)
        index += 1
    raise ValueError(f"no member {step!r} in the container")
