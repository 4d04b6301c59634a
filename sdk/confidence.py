"""Per-field confidence of a JSON output: the mean token log-prob of each value.

The engine reports the log-prob of every generated token under the model's own
distribution (before the constraint's mask). A value's confidence is the mean over
the tokens that overlap its characters in the output, so a field the model had to
be forced into scores low and a field copied from the text scores near 0.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from formcast.grammars.json_spans import value_span


def field_confidence(text: str, token_ids: Sequence[int], logprobs: Sequence[float],
                     decode: Callable[[Sequence[int]], str]) -> dict[str, float]:
    """Mean token log-prob of each leaf value of the JSON ``text``, by JSON pointer.

    Parameters
    ----------
    text : str
        The generated JSON document.
    token_ids, logprobs : sequences of equal length
        The generated tokens and each one's log-prob.
    decode : callable
        Token ids -> text (special tokens skipped), to find where each token ends.

    Returns
    -------
    dict[str, float]
        JSON pointer (``/items/0/name``) -> a mean log-prob in (-inf, 0]. Empty when
        ``text`` is not JSON or the tokens do not spell it.
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return {}
    ends = token_ends(token_ids, decode)
    if len(logprobs) != len(token_ids) or not ends or ends[-1] < len(text.rstrip()):
        return {}
    scores = {}
    for path in leaf_paths(value, ()):
        start, end = value_span(text, path)
        taken = [lp for k, lp in enumerate(logprobs)
                 if (ends[k - 1] if k else 0) < end and ends[k] > start]
        if taken:
            scores[pointer(path)] = min(0.0, sum(taken) / len(taken))
    return scores


def token_ends(token_ids: Sequence[int], decode: Callable[[Sequence[int]], str]) -> list[int]:
    """Character offset in the decoded text where each token's text ends."""
    return [len(decode(token_ids[:k + 1])) for k in range(len(token_ids))]


def leaf_paths(value: Any, path: tuple) -> list[tuple]:
    if isinstance(value, dict) and value:
        return [p for key, item in value.items() for p in leaf_paths(item, path + (key,))]
    if isinstance(value, list) and value:
        return [p for i, item in enumerate(value) for p in leaf_paths(item, path + (i,))]
    return [path]


def pointer(path: tuple) -> str:
    return "".join("/" + str(step).replace("~", "~0").replace("/", "~1") for step in path)
