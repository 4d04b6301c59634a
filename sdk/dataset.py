"""Synthetic datasets whose every record follows a schema, generated resumably.

::

    import formcast

    llm = formcast.load()
    summary = formcast.dataset.generate(
        llm, Person, template="Invent a {{ job }} from {{ city }}.",
        variables={"job": ["nurse", "pilot"], "city": ["Oslo", "Lima"]},
        n=100, output="people.jsonl")

Record ``i`` is generated from prompt ``i % len(prompts)`` with a seed derived from
(``seed``, ``i``, attempt), under the schema's grammar, then validated again
(jsonschema, and pydantic for a class). It is appended to the JSONL as
``{"id", "data", "prompt_id", "seed", "model", "formcast_version"}``. Re-running
the same call after a crash regenerates exactly the ids that are missing; a
manifest next to the output refuses a resume with different parameters. With
``dedupe`` a record equal to an earlier one (canonical JSON) is drawn again with the
next attempt's seed. The summary (counts, throughput, per-field distributions) is
returned and written next to the output.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from formcast.dataset_files import (RecordFile, canonical_json, check_manifest, side_path,
                                    write_json_atomic)
from formcast.dataset_stats import field_summary
from formcast.errors import DatasetError, FormcastError, OutputValidationError

DEFAULT_PROMPT = "Invent one realistic, specific and varied example."


@dataclass(frozen=True, kw_only=True)
class Prompt:
    """One prompt of a run: ``id`` goes into each record as ``prompt_id``."""

    id: str | int
    text: str


@dataclass(frozen=True, kw_only=True)
class Progress:
    """Counters of a run so far, handed to the ``progress`` callback.

    ``done`` counts every record in the file (resumed ones too); the others count this
    run's work: ``valid`` and ``invalid`` generated outputs, ``duplicates`` dropped,
    ``tokens`` generated.
    """

    n: int
    done: int
    resumed: int
    valid: int
    invalid: int
    duplicates: int
    tokens: int
    elapsed_s: float


@dataclass(frozen=True, kw_only=True)
class DatasetSummary:
    """What :func:`generate` did (also written to ``<output stem>.summary.json``).

    Attributes
    ----------
    output, manifest, summary : str
        The three files.
    n, resumed, generated : int
        Records asked for, found in the output at the start, written by this run.
    attempts, invalid, duplicates : int
        Outputs generated this run, how many failed validation (e.g. cut by
        ``max_tokens``) and how many repeated an earlier record; both were redrawn.
    completion_tokens : int
    elapsed_s, records_per_s, tokens_per_s : float
    valid_rate : float
        Valid outputs / outputs generated this run (1.0 when nothing was generated).
    fields : dict
        Per-field statistics over all ``n`` records (see ``formcast.dataset_stats``).
    """

    output: str
    manifest: str
    summary: str
    n: int
    resumed: int
    generated: int
    attempts: int
    invalid: int
    duplicates: int
    completion_tokens: int
    elapsed_s: float
    records_per_s: float
    tokens_per_s: float
    valid_rate: float
    fields: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def generate(llm: Any, schema: Any, *, n: int, output: str | Path,
             prompts: str | Path | Sequence[str | Mapping[str, Any]] | None = None,
             template: str | None = None,
             variables: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
             seed: int = 0, temperature: float = 0.8, top_p: float = 1.0,
             max_tokens: int = 256, dedupe: bool = True, batch_size: int = 8,
             resume: bool = True, max_attempts: int = 10, system: str | None = None,
             show_schema: bool = True,
             progress: Callable[[Progress], None] | None = None) -> DatasetSummary:
    """Generate ``n`` schema-valid records into a JSONL file, resuming a crashed run.

    Parameters
    ----------
    llm : formcast.LLM
    schema : pydantic model, dataclass, TypedDict or JSON Schema dict
        What every record's ``data`` is.
    n : int
        Records wanted; ids are ``0 .. n-1``.
    output : str or Path
        The JSONL written (appended to when resuming). The manifest and summary go
        next to it: ``out.jsonl`` -> ``out.manifest.json``, ``out.summary.json``.
    prompts : JSONL path or list, optional
        The prompts, used in turn (record ``i`` takes prompt ``i % len(prompts)``).
        A JSONL line (or list item) is a string, or an object with ``prompt`` (or
        ``text``) and optionally ``id``.
    template, variables : optional
        Instead of ``prompts``: a Jinja template, filled from ``variables``: a mapping
        of name -> list of values (every combination, in order; a scalar is fixed) or
        a list of mappings (one prompt each). Neither ``prompts`` nor ``template``: one
        generic prompt.
    seed : int
        Run seed; record ``i``'s attempt ``a`` samples with a seed derived from
        (``seed``, ``i``, ``a``), so records differ and a resumed run redraws the same.
    temperature, top_p, max_tokens, system
        Sampling, as in :meth:`formcast.LLM.generate`.
    dedupe : bool
        Redraw records whose data equals an earlier record's (canonical JSON).
    batch_size : int
        Records per engine batch (does not change the records).
    resume : bool
        Continue an existing output made with the same parameters; ``False`` starts
        over (the old records are deleted).
    max_attempts : int
        Draws per record before giving up (invalid and duplicate draws count).
    show_schema : bool
        Append the JSON form to fill (as ``extract`` shows it) to every prompt.
    progress : callable, optional
        Called with a :class:`Progress` after every batch.

    Returns
    -------
    DatasetSummary

    Raises
    ------
    ResumeMismatchError
        The output exists and its manifest holds different parameters.
    DatasetError
        The output is damaged or not a formcast dataset, or a record stayed invalid
        or duplicate for ``max_attempts`` draws (the records written so far are kept).
    ValueError
        Bad arguments (``n < 1``, both ``prompts`` and ``template``, ...).
    """
    from formcast import __version__
    from formcast.extraction import cap_free_strings, extraction_spec, form_lines

    if n < 1 or batch_size < 1 or max_attempts < 1:
        raise ValueError("n, batch_size and max_attempts must be at least 1")
    spec = extraction_spec(schema)  # TypeError for what is not a schema
    json_schema = spec.json_schema
    plan = build_prompts(prompts=prompts, template=template, variables=variables)
    form = "\n".join(form_lines(json_schema, json_schema.get("$defs", {})))
    texts = [f"{p.text.strip()}\n\nAnswer with JSON in this form:\n{form}" if show_schema
             else p.text for p in plan]
    model = _model_name(llm)
    params = {"schema_sha256": _sha256(canonical_json(json_schema)),
              "prompts_sha256": _sha256(canonical_json([[p.id, p.text] for p in plan])),
              "num_prompts": len(plan), "n": n, "seed": seed, "temperature": temperature,
              "top_p": top_p, "max_tokens": max_tokens, "dedupe": dedupe,
              "system": system, "show_schema": show_schema, "model": model}

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    manifest, summary_path = side_path(output, "manifest"), side_path(output, "summary")
    records = RecordFile(output)
    fresh = not resume or not output.exists() or output.stat().st_size == 0
    if fresh:
        write_json_atomic(manifest, {"formcast_version": __version__, "params": params,
                                     "schema": json_schema})
        existing = {}
    else:
        check_manifest(manifest, params)
        existing = records.recover(n).records

    seen = {canonical_json(r.get("data")) for r in existing.values()} if dedupe else set()
    todo = [(i, 0) for i in range(n) if i not in existing]  # (record id, attempt); a heap
    heapq.heapify(todo)
    stats = {"valid": 0, "invalid": 0, "duplicates": 0, "tokens": 0}
    start = time.perf_counter()
    exhausted: list[int] = []
    gen_schema = cap_free_strings(json_schema)
    resumed = len(existing)

    def report() -> None:
        if progress is not None:
            progress(Progress(n=n, done=len(existing), resumed=resumed,
                              elapsed_s=time.perf_counter() - start, **stats))

    records.open(truncate=fresh)
    try:
        report()
        while todo and not exhausted:
            batch = [heapq.heappop(todo) for _ in range(min(batch_size, len(todo)))]
            seeds = [record_seed(seed, i, attempt) for i, attempt in batch]
            results = llm.generate_batch([texts[i % len(plan)] for i, _ in batch],
                                         json_schema=gen_schema, max_tokens=max_tokens,
                                         temperature=temperature, top_p=top_p, seed=seeds,
                                         system=system)
            for (i, attempt), sample_seed, result in zip(batch, seeds, results):
                stats["tokens"] += _tokens(llm, result)
                data = _validated(result, spec)
                if data is None:
                    stats["invalid"] += 1
                elif dedupe and canonical_json(data) in seen:
                    stats["duplicates"] += 1
                else:
                    stats["valid"] += 1
                    seen.add(canonical_json(data))
                    record = {"id": i, "data": data, "prompt_id": plan[i % len(plan)].id,
                              "seed": sample_seed, "model": model,
                              "formcast_version": __version__}
                    records.append(record)
                    existing[i] = record
                    continue
                if attempt + 1 < max_attempts:
                    heapq.heappush(todo, (i, attempt + 1))
                else:
                    exhausted.append(i)
            report()
    finally:
        records.close()
    if exhausted:
        raise DatasetError(
            f"record {exhausted[0]} was invalid or a duplicate in all {max_attempts} draws "
            f"({stats['invalid']} invalid and {stats['duplicates']} duplicate draws this run); "
            f"{len(existing)}/{n} records are written and a rerun resumes. Raise max_tokens, "
            f"the temperature or max_attempts, vary the prompts, or turn dedupe off")

    elapsed = time.perf_counter() - start
    attempts = stats["valid"] + stats["invalid"] + stats["duplicates"]
    summary = DatasetSummary(
        output=str(output), manifest=str(manifest), summary=str(summary_path), n=n,
        resumed=resumed, generated=stats["valid"], attempts=attempts,
        invalid=stats["invalid"], duplicates=stats["duplicates"],
        completion_tokens=stats["tokens"], elapsed_s=round(elapsed, 3),
        records_per_s=round(stats["valid"] / elapsed, 3) if elapsed > 0 else 0.0,
        tokens_per_s=round(stats["tokens"] / elapsed, 1) if elapsed > 0 else 0.0,
        valid_rate=round((attempts - stats["invalid"]) / attempts, 4) if attempts else 1.0,
        fields=field_summary((existing[i]["data"] for i in sorted(existing)), json_schema))
    write_json_atomic(summary_path, summary.to_dict())
    return summary


def build_prompts(*, prompts: str | Path | Sequence[str | Mapping[str, Any]] | None = None,
                  template: str | None = None,
                  variables: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None
                  ) -> list[Prompt]:
    """The prompts of a run, in order (no state change; reads a JSONL path).

    Raises
    ------
    ValueError
        Both or a malformed source: the message names the file line or item.
    """
    if prompts is not None and template is not None:
        raise ValueError("give prompts or a template, not both")
    if variables is not None and template is None:
        raise ValueError("variables fill a template; give template= too")
    if template is not None:
        return _from_template(template, variables)
    if prompts is None:
        return [Prompt(id=0, text=DEFAULT_PROMPT)]
    if isinstance(prompts, (str, Path)):
        items, where = _read_jsonl(Path(prompts)), str(prompts)
    else:
        items, where = list(prompts), "prompts"
    plan = []
    for index, item in enumerate(items):
        if isinstance(item, Mapping):
            text = item.get("prompt", item.get("text"))
            pid = item.get("id", index)
        else:
            text, pid = item, index
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{where} item {index + 1} is neither a non-empty string nor an "
                             f"object with a 'prompt' (or 'text') string")
        plan.append(Prompt(id=pid, text=text))
    if not plan:
        raise ValueError(f"{where} holds no prompts")
    return plan


def _from_template(template: str, variables: Mapping[str, Any] | Sequence[Mapping[str, Any]]
                   | None) -> list[Prompt]:
    import jinja2
    from jinja2.sandbox import SandboxedEnvironment

    env = SandboxedEnvironment(undefined=jinja2.StrictUndefined, autoescape=False)
    try:
        compiled = env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the template does not parse (line {exc.lineno}): {exc.message}") \
            from exc
    if variables is None:
        rows: list[Mapping[str, Any]] = [{}]
    elif isinstance(variables, Mapping):
        names = list(variables)
        axes = [v if isinstance(v, list) else [v] for v in variables.values()]
        rows = [dict(zip(names, combo)) for combo in itertools.product(*axes)]
    else:
        rows = list(variables)
        if not all(isinstance(r, Mapping) for r in rows):
            raise ValueError("variables must be a mapping of name -> values or a list of "
                             "mappings")
    try:
        plan = [Prompt(id=i, text=compiled.render(**row)) for i, row in enumerate(rows)]
    except jinja2.UndefinedError as exc:
        raise ValueError(f"the template uses a variable that was not given: {exc.message}") \
            from exc
    if not plan:
        raise ValueError("the variables give no combination (an empty list?)")
    return plan


def _read_jsonl(path: Path) -> list[Any]:
    items = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            items.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number} is not JSON: {exc.msg}") from exc
    return items


def record_seed(run_seed: int, index: int, attempt: int) -> int:
    """The sampling seed of record ``index``'s draw ``attempt`` (31 bits; pure)."""
    digest = hashlib.blake2b(f"{run_seed}/{index}/{attempt}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFF_FFFF


def _validated(result: Any, spec: Any) -> Any:
    """The record's JSON data, or None when the output is not a valid record."""
    import jsonschema

    if isinstance(result, FormcastError):
        return None
    try:
        spec.parse(result.text)  # pydantic for a class, jsonschema for a dict
        data = json.loads(result.text)
        jsonschema.validate(data, spec.json_schema)
    except (OutputValidationError, ValueError, jsonschema.ValidationError):
        return None
    return data


def _tokens(llm: Any, result: Any) -> int:
    if isinstance(result, FormcastError):
        text = getattr(result, "text", "")
        return len(llm.tokenizer.encode(text, add_special_tokens=False)) if text else 0
    return result.usage.completion_tokens


def _model_name(llm: Any) -> str:
    engine = llm.engine
    quant = getattr(engine, "quantization", None)
    return f"{engine.name}" + (f" ({quant})" if quant else "")


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
