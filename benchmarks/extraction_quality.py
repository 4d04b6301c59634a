"""Extraction quality: ``LLM.extract`` against two simpler ways, same model, same run.

Methods, each over every text of ``data/extraction_tune.jsonl`` (hand-written texts with
gold fields, schemas in ``extraction_data.py``):

A  ``llm.extract(text, Model)``: formcast's extraction prompt (fields, types,
   descriptions, the null rule) + generation constrained by the model's schema.
B  a plain user prompt, "Extract the information as JSON." + the text, with the
   same JSON Schema constraint as A generates under (``llm.generate(...,
   json_schema=...)`` with the schema A compiles: free strings capped at
   ``formcast.extraction.MAX_FREE_STRING`` characters), so A - B is the prompt alone.
C  formcast's extraction prompt without any constraint: the first ``{`` to the last
   ``}`` of the output goes through ``json.loads`` and pydantic validation. (The
   prompt is A's, so C measures what the constraint adds; a plain prompt without
   the field list cannot name the fields at all.)

Scores:
- schema-valid rate: outputs that complete and validate against the pydantic model.
- field accuracy: correct fields / all gold fields; an invalid output scores 0 on
  each of its fields. Also shown over valid outputs only.
- A field is correct when the validated value equals the gold value (or one of the
  listed alternates) after normalization: strings compared case- and
  whitespace-insensitively, numbers by numeric equality (1e-6), booleans exactly,
  dates as ISO 8601 strings (pydantic parses them, so "2025-05-14" == date(2025,5,14)),
  null only equals null.

Run: ``python benchmarks/extraction_quality.py [--quantization auto|none|int4] [--limit N]``.
The acceptance line: A is 100% valid and ahead of B on field accuracy.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from extraction_data import SCHEMAS, SPLITS, Item, load_items  # noqa: F401  (same folder)
from pydantic import BaseModel, ValidationError

DATA = SPLITS["tune"]
PLAIN_PROMPT = "Extract the information as JSON."


# -- data and scoring ----------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Outcome:
    """One method's result on one item: the validated value (JSON form) or None."""

    value: dict[str, Any] | None
    text: str
    tokens: int
    error: str | None = None

    @property
    def valid(self) -> bool:
        return self.value is not None


def normalize(value: Any) -> Any:
    """The comparable form of a field value (see the module docstring)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, (datetime.date, datetime.datetime)):
        return value.isoformat()
    if isinstance(value, str):
        return " ".join(value.split()).casefold()
    return value


def field_correct(predicted: Any, gold: Any, alternates: list[Any]) -> bool:
    p = normalize(predicted)
    for g in (gold, *alternates):
        g = normalize(g)
        if isinstance(p, float) and isinstance(g, float):
            if math.isclose(p, g, rel_tol=0, abs_tol=1e-6):
                return True
        elif type(p) is type(g) and p == g:
            return True
    return False


def correct_fields(item: Item, outcome: Outcome) -> int:
    if outcome.value is None:
        return 0
    return sum(field_correct(outcome.value.get(name), gold, item.alternates.get(name, []))
               for name, gold in item.gold.items())


def validated(model: type[BaseModel], data: Any) -> dict[str, Any]:
    return model.model_validate(data).model_dump(mode="json")


# -- the three methods -----------------------------------------------------------------------
def method_a(llm: Any, items: list[Item], model: type[BaseModel], max_tokens: int
             ) -> list[Outcome]:
    """formcast's extract (prompt + constraint), through extract_batch."""
    from formcast import FormcastError

    values = llm.extract_batch([it.text for it in items], model, max_tokens=max_tokens)
    outcomes = []
    for value in values:
        if isinstance(value, FormcastError):
            text = getattr(value, "text", "")
            outcomes.append(Outcome(value=None, text=text, tokens=_count(llm, text),
                                    error=f"{type(value).__name__}: {value}"))
        else:
            data = value.model_dump(mode="json")
            text = json.dumps(data, separators=(",", ":"))
            outcomes.append(Outcome(value=data, text=text, tokens=_count(llm, text)))
    return outcomes


def method_b(llm: Any, items: list[Item], model: type[BaseModel], max_tokens: int
             ) -> list[Outcome]:
    """A plain prompt with the same JSON Schema constraint as A."""
    from formcast.extraction import cap_free_strings

    prompts = [f"{PLAIN_PROMPT}\n\n{it.text}" for it in items]
    results = llm.generate_batch(prompts, json_schema=cap_free_strings(model.model_json_schema()),
                                 max_tokens=max_tokens)
    return [_from_completion(llm, r, lambda c: validated(model, c.value)) for r in results]


def method_c(llm: Any, items: list[Item], model: type[BaseModel], max_tokens: int
             ) -> list[Outcome]:
    """formcast's extraction prompt, unconstrained; json.loads + pydantic validation."""
    from formcast.extraction import extraction_messages

    schema = model.model_json_schema()
    prompts = [extraction_messages(it.text, schema) for it in items]
    results = llm.generate_batch(prompts, max_tokens=max_tokens)
    return [_from_completion(llm, r, lambda c: validated(model, json.loads(_json_span(c.text))))
            for r in results]


def _json_span(text: str) -> str:
    start, end = text.find("{"), text.rfind("}")
    return text[start:end + 1] if 0 <= start < end else text


def _from_completion(llm: Any, result: Any, read: Any) -> Outcome:
    from formcast import FormcastError

    if isinstance(result, FormcastError):
        text = getattr(result, "text", "")
        return Outcome(value=None, text=text, tokens=_count(llm, text),
                       error=f"{type(result).__name__}: {result}")
    tokens = result.usage.completion_tokens
    if result.finish_reason == "length":
        return Outcome(value=None, text=result.text, tokens=tokens, error="cut at max_tokens")
    try:
        return Outcome(value=read(result), text=result.text, tokens=tokens)
    except (ValueError, ValidationError) as exc:  # JSONDecodeError is a ValueError
        return Outcome(value=None, text=result.text, tokens=tokens,
                       error=f"{type(exc).__name__}: {str(exc).splitlines()[0]}")


def _count(llm: Any, text: str) -> int:
    return len(llm.tokenizer.encode(text, add_special_tokens=False)) if text else 0


METHODS = {"A": ("extract (formcast prompt + constraint)", method_a),
           "B": ("plain prompt + same constraint", method_b),
           "C": ("formcast prompt, unconstrained + json.loads", method_c)}


# -- report ---------------------------------------------------------------------------------
@dataclass(kw_only=True)
class Tally:
    items: int = 0
    valid: int = 0
    fields: int = 0
    correct: int = 0
    valid_fields: int = 0
    tokens: int = 0
    seconds: float = 0.0

    def add(self, item: Item, outcome: Outcome) -> None:
        self.items += 1
        self.fields += len(item.gold)
        self.tokens += outcome.tokens
        if outcome.valid:
            self.valid += 1
            self.valid_fields += len(item.gold)
            self.correct += correct_fields(item, outcome)

    @property
    def valid_rate(self) -> float:
        return self.valid / self.items if self.items else 0.0

    @property
    def accuracy(self) -> float:
        return self.correct / self.fields if self.fields else 0.0

    @property
    def accuracy_on_valid(self) -> float:
        return self.correct / self.valid_fields if self.valid_fields else 0.0


def print_report(totals: dict[str, Tally], per_schema: dict[str, dict[str, Tally]]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    table = Table(title="Extraction quality (same model, same run)", title_justify="left")
    for col in ("method", "valid", "field acc", "acc | valid", "tokens", "seconds"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for key, t in totals.items():
        table.add_row(f"{key}  {METHODS[key][0]}", f"{t.valid}/{t.items} {t.valid_rate:6.1%}",
                      f"{t.accuracy:6.1%}", f"{t.accuracy_on_valid:6.1%}", str(t.tokens),
                      f"{t.seconds:.1f}")
    console.print(table)

    schema_table = Table(title="Field accuracy per schema", title_justify="left")
    schema_table.add_column("schema")
    for key in totals:
        schema_table.add_column(key, justify="right")
    for name, tallies in per_schema.items():
        schema_table.add_row(name, *(f"{tallies[k].accuracy:6.1%} ({tallies[k].valid}/"
                                     f"{tallies[k].items} valid)" for k in totals))
    console.print(schema_table)

    if "A" in totals:
        a = totals["A"]
        for other in (k for k in totals if k != "A"):
            o = totals[other]
            console.print(f"A - {other}: field accuracy {100 * (a.accuracy - o.accuracy):+.1f} "
                          f"points, valid rate {100 * (a.valid_rate - o.valid_rate):+.1f} points")
    if {"A", "B"} <= set(totals):
        a, b = totals["A"], totals["B"]
        ok = a.valid == a.items and a.accuracy > b.accuracy
        console.print(f"acceptance (A 100% valid and ahead of B): {'PASS' if ok else 'FAIL'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--quantization", choices=("auto", "none", "int4", "int8"),
                        default="auto", help="engine weights (auto: int4 for the Q4_1 GGUF)")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--limit", type=int, default=None, help="items per schema")
    parser.add_argument("--methods", default="ABC")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--show-errors", action="store_true", help="print every wrong field")
    parser.add_argument("--json", type=Path, default=None, help="write per-item outcomes here")
    args = parser.parse_args(argv)

    import formcast

    items = load_items(args.data)
    groups: dict[str, list[Item]] = {}
    for it in items:
        groups.setdefault(it.schema, []).append(it)
    if args.limit:
        groups = {k: v[:args.limit] for k, v in groups.items()}
    options = {"quantization": None if args.quantization == "none" else args.quantization}
    llm = formcast.load(args.model, device=args.device, **options)
    print(f"{llm!r}, {sum(map(len, groups.values()))} items, quantization="
          f"{llm.engine.quantization or 'none'}", file=sys.stderr)

    totals = {k: Tally() for k in args.methods}
    per_schema = {name: {k: Tally() for k in args.methods} for name in groups}
    records = []
    for name, group in groups.items():
        model = SCHEMAS[name]
        for key in args.methods:
            start = time.perf_counter()
            outcomes = METHODS[key][1](llm, group, model, args.max_tokens)
            elapsed = time.perf_counter() - start
            totals[key].seconds += elapsed
            per_schema[name][key].seconds += elapsed
            for it, outcome in zip(group, outcomes):
                totals[key].add(it, outcome)
                per_schema[name][key].add(it, outcome)
                records.append({"method": key, "schema": name, "text": it.text, "gold": it.gold,
                                "value": outcome.value, "output": outcome.text,
                                "error": outcome.error,
                                "correct": correct_fields(it, outcome), "fields": len(it.gold)})
                if args.show_errors:
                    _show_errors(key, it, outcome)
            print(f"{name:8s} {key}: {elapsed:6.1f} s", file=sys.stderr, flush=True)
    print_report(totals, per_schema)
    if args.json:
        args.json.write_text(json.dumps(records, indent=1, ensure_ascii=False))
    return 0


def _show_errors(key: str, item: Item, outcome: Outcome) -> None:
    if outcome.value is None:
        print(f"  [{key}] INVALID {item.text[:50]!r}: {outcome.error} | {outcome.text[:120]!r}")
        return
    for name, gold in item.gold.items():
        got = outcome.value.get(name)
        if not field_correct(got, gold, item.alternates.get(name, [])):
            print(f"  [{key}] {item.schema}.{name}: got {got!r}, gold {gold!r}")


if __name__ == "__main__":
    raise SystemExit(main())
