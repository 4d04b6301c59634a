"""Evaluation tasks: items, whether an output satisfies an item's constraint, and
whether it matches the answer.

A task is a JSONL file (or a list of dicts), one item a line::

    {"id": "s1", "prompt": "...", "answer": "positive",
     "choices": ["positive", "negative", "neutral"]}
    {"prompt": "What is 7 + 5?", "answer": "12", "regex": "-?[0-9]+"}
    {"prompt": "...", "answer": {"city": "Paris"}, "json_schema": {...}}
    {"prompt": "...", "answer": "3 + 4", "grammar": "root ::= ..."}   # EBNF (GBNF)
    {"prompt": "...", "answer": "...", "lark": "start: ..."}

Exactly one constraint per item; optional ``id``, ``max_tokens`` and ``system``.
Validity is checked independently of the token masks: ``re.fullmatch``, ``json`` +
``jsonschema``, ``lark``'s Earley parser, and xgrammar's string matcher for EBNF.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

KINDS = ("choices", "regex", "json_schema", "grammar", "lark")


@dataclass(frozen=True, kw_only=True)
class TaskItem:
    """One evaluation item.

    Attributes
    ----------
    id : str | int
    prompt : str
    answer : Any
        A string, or any JSON value for a ``json_schema`` item (compared parsed).
    kind : str
        One of :data:`KINDS`.
    constraint : list[str] | str | dict
        The choices, the pattern, the schema or the grammar text.
    max_tokens : int | None
        Overrides the run's default.
    system : str | None
    """

    id: str | int
    prompt: str
    answer: Any
    kind: str
    constraint: Any
    max_tokens: int | None = None
    system: str | None = None

    @property
    def constraint_key(self) -> str:
        """Items with the same key can share one constrained batch."""
        return f"{self.kind}:{json.dumps(self.constraint, sort_keys=True)}"


def load_task(task: str | Path | Sequence[Mapping[str, Any]]) -> list[TaskItem]:
    """Read a task: a JSONL path or a list of item dicts (no state change).

    Raises
    ------
    ValueError
        A malformed item; the message names its line (or position) and what is wrong.
    """
    if isinstance(task, (str, Path)):
        path = Path(task)
        rows: list[tuple[str, Any]] = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append((f"{path}:{number}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number} is not JSON: {exc.msg}") from exc
    else:
        rows = [(f"item {i + 1}", item) for i, item in enumerate(task)]
    items = [_item(where, raw, index) for index, (where, raw) in enumerate(rows)]
    if not items:
        raise ValueError("the task holds no items")
    ids = [item.id for item in items]
    if len(set(map(str, ids))) != len(ids):
        raise ValueError("item ids must be unique")
    return items


def _item(where: str, raw: Any, index: int) -> TaskItem:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: an item is a JSON object")
    if not isinstance(raw.get("prompt"), str) or not raw["prompt"].strip():
        raise ValueError(f"{where}: 'prompt' must be a non-empty string")
    if "answer" not in raw:
        raise ValueError(f"{where}: 'answer' is missing")
    kinds = [k for k in KINDS if raw.get(k) is not None]
    if len(kinds) != 1:
        raise ValueError(f"{where}: give exactly one of {', '.join(KINDS)} (got "
                         f"{', '.join(kinds) or 'none'})")
    kind = kinds[0]
    constraint = raw[kind]
    answer = raw["answer"]
    if kind == "choices":
        if not (isinstance(constraint, list) and constraint
                and all(isinstance(c, str) and c for c in constraint)):
            raise ValueError(f"{where}: 'choices' must be a list of non-empty strings")
        if answer not in constraint:
            raise ValueError(f"{where}: the answer {answer!r} is not one of the choices")
    elif kind == "json_schema":
        if not isinstance(constraint, dict):
            raise ValueError(f"{where}: 'json_schema' must be a JSON object")
    else:
        if not isinstance(constraint, str) or not constraint.strip():
            raise ValueError(f"{where}: {kind!r} must be a non-empty string")
        if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
            raise ValueError(f"{where}: the answer of a {kind} item is a string (or number)")
        answer = str(answer)
    max_tokens = raw.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"{where}: 'max_tokens' must be a positive integer")
    return TaskItem(id=raw.get("id", index), prompt=raw["prompt"], answer=answer, kind=kind,
                    constraint=constraint, max_tokens=max_tokens, system=raw.get("system"))


# -- validity -----------------------------------------------------------------------
def parse_output(item: TaskItem, text: str) -> tuple[bool, Any]:
    """(does ``text`` satisfy the item's constraint, its value) — no state change.

    Surrounding whitespace is ignored; the value is the parsed JSON for a
    ``json_schema`` item (None when invalid) and the stripped text otherwise.
    """
    text = text.strip()
    if item.kind == "choices":
        return text in item.constraint, text
    if item.kind == "regex":
        return re.fullmatch(item.constraint, text) is not None, text
    if item.kind == "json_schema":
        import jsonschema

        try:
            value = json.loads(text)
            jsonschema.validate(value, item.constraint)
        except (ValueError, jsonschema.ValidationError):
            return False, None
        return True, value
    if item.kind == "lark":
        import lark

        try:
            _lark_parser(item.constraint).parse(text)
        except lark.exceptions.LarkError:
            return False, text
        return True, text
    return _ebnf_accepts(item.constraint, text), text


@lru_cache(maxsize=64)
def _lark_parser(grammar: str) -> Any:
    import lark

    return lark.Lark(grammar, parser="earley")


@lru_cache(maxsize=64)
def _ebnf_compiled(grammar: str) -> Any:
    import xgrammar

    # an empty vocabulary: this matcher takes strings, not tokens
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo([]), cache_enabled=False)
    return compiler.compile_grammar(grammar)


def _ebnf_accepts(grammar: str, text: str) -> bool:
    """Whether an EBNF (GBNF) grammar derives exactly ``text``: xgrammar's string
    matcher (no tokenizer, no masks)."""
    import xgrammar

    matcher = xgrammar.GrammarMatcher(_ebnf_compiled(grammar), terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


# -- matching -----------------------------------------------------------------------
def normalize_text(text: str) -> str:
    """Case-, whitespace- and punctuation-insensitive form of a string."""
    kept = "".join(" " if unicodedata.category(ch).startswith("P") else ch
                   for ch in unicodedata.normalize("NFKC", text).casefold())
    return " ".join(kept.split())


def _normalize_value(value: Any) -> Any:
    if isinstance(value, str):
        return normalize_text(value)
    if isinstance(value, list):
        return [_normalize_value(v) for v in value]
    if isinstance(value, dict):
        return {normalize_text(k): _normalize_value(v) for k, v in value.items()}
    return value


def match(item: TaskItem, text: str) -> tuple[bool, bool]:
    """(exact match, normalized match) of an output against the item's answer.

    JSON items compare parsed values (key order and spacing never matter; normalized
    also ignores case/punctuation inside strings); other items compare the stripped
    text with the answer, then both normalized. A JSON output that does not parse
    matches nothing; free text can still match after normalization.
    """
    if item.kind == "json_schema":
        try:
            value = json.loads(text.strip())
        except ValueError:
            return False, False
        exact = _same_json(value, item.answer)
        return exact, exact or _same_json(_normalize_value(value), _normalize_value(item.answer))
    stripped = text.strip()
    return stripped == item.answer, normalize_text(stripped) == normalize_text(item.answer)


def _same_json(a: Any, b: Any) -> bool:
    # json's == treats 1 == 1.0 == True; keep booleans apart from numbers
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_json(x, y) for x, y in zip(a, b))
    return a == b


def choice_label(item: TaskItem, text: str) -> str | None:
    """The choice an output names (exactly, else after normalization), or None."""
    stripped = text.strip()
    if stripped in item.constraint:
        return stripped
    wanted = normalize_text(stripped)
    for choice in item.constraint:
        if normalize_text(choice) == wanted:
            return choice
    return None
