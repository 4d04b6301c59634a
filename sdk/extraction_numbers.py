"""Grounded numbers chosen whole: every number the text writes, scored in the field's place.

Decoded digit by digit, a grounded number follows its likeliest first digit: a
"servings" field after "Serves: 8 ... bake at 175 °C" starts with the common "1",
and the mask then leads it to 175. :func:`rechosen` scores each number the text
writes (of the field's kind: whole numbers for an integer field) after the prompt
and the output up to the value, by the mean log-prob of its tokens and the
character that follows it, and keeps the best. The mean, not the sum: a sum
favours numbers of fewer tokens ("3" over "35"). The engine computes the
prompt and output once, from its prefix cache, and each number's own tokens
after it (:meth:`~formcast.engine.Engine.continuation_logprobs`).

Only fields the plan grounds to numbers, whose value is one of the text's numbers
(not a number the model wrote for lack of one), outside arrays of numbers (whose
items are kept distinct), are re-chosen; greedy extraction only.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

from formcast.completion import Completion
from formcast.confidence import leaf_paths, pointer, token_ends
from formcast.errors import FormcastError, OutputValidationError, RequestError
from formcast.grammars.grounding_text import text_numbers
from formcast.grammars.json_spans import value_span

@dataclasses.dataclass(frozen=True)
class NumberField:
    """A grounded number of an output: where it is, and the numbers it could be."""

    path: tuple
    start: int
    end: int
    choices: tuple[str, ...]     # the text's numbers as JSON writes them, one per value


def rechosen(results: list[Completion | FormcastError], prompts: Sequence[Any],
             texts: Sequence[str], plan: Any, parse: Callable[[str], Any], tokenizer: Any,
             engine: Any) -> list[Completion | FormcastError]:
    """``results`` with each grounded number field set to the text's number the model
    scores best in its place (:mod:`formcast.extraction_numbers`).

    Parameters
    ----------
    results : list
        Completions of the extraction (errors pass through), by text.
    prompts : sequence
        Each text's prompt token ids (or the error refusing it).
    texts : sequence of str
    plan : GroundingPlan
        Which paths hold grounded numbers, and which of them integers.
    parse : callable
        The spec's parser: a changed output is parsed again (kept as it was if the
        new one fails validation).
    tokenizer
    engine : Engine
        Its ``continuation_logprobs`` scores the choices.
    """
    if not plan.numbers:
        return results
    asked: list[tuple[int, NumberField]] = []       # (result, field), scored together
    prefixes, conts = [], []
    for i, result in enumerate(results):
        if not isinstance(result, Completion) or isinstance(prompts[i], FormcastError):
            continue
        fields = number_fields(result.text, texts[i], plan)
        if not fields:
            continue
        ends = token_ends(result.token_ids,
                          lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        for field in fields:
            if field.start not in ends:   # (the value starts inside a token)
                continue
            after = result.text[field.end:field.end + 1]
            asked.append((i, field))
            prefixes.append(list(prompts[i]) + list(result.token_ids[:ends.index(field.start) + 1]))
            conts.append([tokenizer.encode(c + after, add_special_tokens=False)
                          for c in field.choices])
    if not asked:
        return results
    try:
        scores = engine.continuation_logprobs(prefixes, conts)
    except RequestError:  # (no room to score them now: the values decoded stand)
        return results
    picks: dict[int, list[tuple[NumberField, str, float]]] = {}
    for (i, field), lps in zip(asked, scores):
        current = float(json.loads(results[i].text[field.start:field.end]))
        means = [sum(lp) / len(lp) for lp in lps]
        best = max(range(len(means)), key=lambda k: (means[k],
                                                     float(field.choices[k]) == current))
        if float(field.choices[best]) != current:
            picks.setdefault(i, []).append((field, field.choices[best], means[best]))
    out = list(results)
    for i, chosen in picks.items():
        out[i] = _replaced(results[i], chosen, parse, tokenizer)
    return out


def number_fields(output: str, text: str, plan: Any) -> list[NumberField]:
    """The grounded number fields of the JSON ``output`` that the numbers of ``text``
    could fill in more than one way, with their spans."""
    try:
        value = json.loads(output)
    except json.JSONDecodeError:
        return []
    written = sorted((form.decode() for form in text_numbers(text)), key=len)
    fields = []
    for path in leaf_paths(value, ()):
        leaf = _at(value, path)
        if isinstance(leaf, bool) or not isinstance(leaf, (int, float)) or not path \
                or isinstance(path[-1], int) or not _matches(path, plan.numbers):
            continue
        integer = _matches(path, plan.integers)
        choices: dict[float, str] = {}   # (value -> its shortest form)
        for form in written:
            if not (integer and "." in form):
                choices.setdefault(float(form), form)
        if len(choices) < 2 or float(leaf) not in choices:
            continue
        start, end = value_span(output, path)
        fields.append(NumberField(path, start, end, tuple(choices.values())))
    return fields


def _replaced(result: Completion, picks: list[tuple[NumberField, str, float]],
              parse: Callable[[str], Any], tokenizer: Any) -> Completion:
    """``result`` with the picked numbers written in (as it was if that fails to parse)."""
    text = result.text
    for field, choice, _ in sorted(picks, key=lambda p: -p[0].start):
        text = text[:field.start] + choice + text[field.end:]
    try:
        value = parse(text)
    except OutputValidationError:
        return result
    confidence = result.field_confidence
    if confidence is not None:
        confidence = {**confidence, **{pointer(f.path): min(0.0, m) for f, _, m in picks}}
    return dataclasses.replace(result, text=text, value=value, field_confidence=confidence,
                               token_ids=tuple(tokenizer.encode(text, add_special_tokens=False)))


def _at(value: Any, path: tuple) -> Any:
    for step in path:
        value = value[step]
    return value


def _matches(path: tuple, patterns: frozenset[tuple[str, ...]]) -> bool:
    """Whether ``path`` (keys and indices) is one of ``patterns`` (``"*"``: any index)."""
    return any(len(p) == len(path) and all(a == b or (a == "*" and isinstance(b, int))
                                           for a, b in zip(p, path)) for p in patterns)
