"""The ``formcast`` command line: models, pull, info, generate, extract, dataset, eval, serve.

Exit codes: 0 success, 1 a runtime failure (fetch, engine, output cut short),
2 a usage error (bad option, unreadable file, invalid schema or constraint,
unknown model). Errors print one clear line on stderr, never a traceback.
Progress and status go to stderr, results to stdout (or the --output file), so
``formcast generate ... > out.txt`` captures only the answer.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, SpinnerColumn,
                           Task, TextColumn, TimeElapsedColumn)
from rich.table import Table
from rich.text import Text

import formcast
from formcast.cli_inputs import check_task_constraints, load_schema, read_json_schema, read_text, read_texts, read_vars
from formcast.cli_reports import (DatasetRateColumn, cache_files, model_card, parameter_count,
                                  print_dataset_summary, print_eval_summary, versions)
from formcast.errors import (ConstraintError, FormcastError, IncompleteOutputError,
                             ModelNotFoundError, OutputValidationError, RequestError)
from formcast.cli_models import models_command
from formcast.extraction import extraction_spec
from formcast.server.command import QUANTIZATIONS, serve_command
from formcast.spec import output_spec

app = typer.Typer(name="formcast", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_enable=False,
                  help="Structured generation on formcast's embedded engine (no API key).")

log = logging.getLogger("formcast.cli")
EXIT_RUNTIME = 1
EXIT_USAGE = 2
DTYPES = ("float32", "bfloat16", "float16")
app.command("serve")(serve_command)
app.command("models")(models_command)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"formcast {formcast.__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: Annotated[bool, typer.Option(  # noqa: ARG001  (acted on by its callback)
                 "--version", callback=_print_version, is_eager=True, help="Print the version.")
             ] = False,
             log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")
                                  ] = "warning") -> None:
    """Structured generation on formcast's embedded engine (no API key)."""
    if log_level.lower() not in ("debug", "info", "warning", "error"):
        raise typer.BadParameter(f"{log_level!r} is not debug, info, warning or error",
                                 param_hint="--log-level")
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # (set apart: basicConfig leaves the level alone when the root logger has handlers)
    logging.getLogger().setLevel(log_level.upper())


@dataclass(frozen=True, kw_only=True)
class CliContext:
    """What the commands need from outside; tests pass their own ``load``.

    Attributes
    ----------
    load : callable
        ``load(model, device=..., dtype=..., **engine_options) -> LLM``.
    """

    load: Callable[..., Any]


def _default_load(model: str, **kwargs: Any) -> Any:
    return formcast.load(model, **kwargs)


def _err() -> Console:
    # Built per call so the console follows the current sys.stderr (CliRunner swaps it).
    return Console(stderr=True, highlight=False)


def _fail(message: str, code: int) -> NoReturn:
    _err().print(Text("error: ", style="bold red") + Text(message))
    raise typer.Exit(code)


@contextmanager
def _errors_to_exit_codes() -> Iterator[None]:
    """Turn formcast's (and the OS's) exceptions into one line and an exit code."""
    try:
        yield
    except (ConstraintError, ModelNotFoundError, RequestError) as exc:
        _fail(str(exc), EXIT_USAGE)
    except (ValueError, TypeError) as exc:  # arguments the SDK rejected (bad option, schema)
        _fail(str(exc), EXIT_USAGE)
    except IncompleteOutputError as exc:
        _fail(f"{exc}\npartial output: {exc.text!r}", EXIT_RUNTIME)
    except OutputValidationError as exc:
        _fail(f"{exc}\noutput: {exc.text!r}", EXIT_RUNTIME)
    except (FormcastError, OSError, RuntimeError) as exc:
        _fail(f"{type(exc).__name__}: {exc}", EXIT_RUNTIME)
    except KeyboardInterrupt:
        _fail("interrupted", 130)


def _load_llm(ctx: typer.Context, model: str, device: str, dtype: str | None,
              quantization: str | None) -> Any:
    import torch

    if dtype is not None and dtype not in DTYPES:
        raise typer.BadParameter(f"{dtype!r} is not one of {', '.join(DTYPES)}",
                                 param_hint="--dtype")
    if quantization not in (None, *QUANTIZATIONS):
        raise typer.BadParameter(f"{quantization!r} is not {', '.join(QUANTIZATIONS[:-1])} or "
                                 f"{QUANTIZATIONS[-1]}", param_hint="--quantization")
    options: dict[str, Any] = {"device": device,
                               "dtype": getattr(torch, dtype) if dtype else None}
    if quantization:
        options["quantization"] = None if quantization == "none" else quantization
    log.info("loading %s (device %s, dtype %s, quantization %s)", model, device,
             dtype or "default", quantization or "default")
    state = ctx.find_object(CliContext)
    load = state.load if state is not None else _default_load
    with _err().status(f"loading {model} ..."):
        return load(model, **options)


# Options shared by the commands that load a model.
ModelOpt = Annotated[str, typer.Option("--model", "-m",
                                       help="Registry name, .gguf file or HF folder.")]
DeviceOpt = Annotated[str, typer.Option(help="auto, cpu or cuda[:N].")]
DtypeOpt = Annotated[str | None, typer.Option(help="float32, bfloat16 or float16.")]
QuantOpt = Annotated[str | None, typer.Option(
    help="CPU weights: none, auto, int4, int8 or gguf (the file's own blocks).")]


# -- pull ---------------------------------------------------------------------------
@app.command()
def pull(model: Annotated[str, typer.Argument(
        help="Registry name (formcast models lists them).")] = "smollm2") -> None:
    """Fetch a model into the local cache and print its path."""
    from formcast.engine.hub import resolve_model

    with _errors_to_exit_codes():
        source = resolve_model(model)
    typer.echo(str(source.path))


# -- info ---------------------------------------------------------------------------
@app.command()
def info(ctx: typer.Context,
         model: Annotated[str, typer.Argument(help="Registry name or path.")] = "smollm2",
         device: DeviceOpt = "auto", dtype: DtypeOpt = None, quantization: QuantOpt = None,
         as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """Show a model's shape, dtype, device, cache files, tokenizer and versions."""
    from formcast.engine.hub import formcast_home, resolve_model

    with _errors_to_exit_codes():
        source = resolve_model(model)
        llm = _load_llm(ctx, model, device, dtype, quantization)
    engine, cfg, tok = llm.engine, llm.engine.model.config, llm.tokenizer
    report = {
        "model": {"name": engine.name, "source": str(source.path), "format": source.kind,
                  "architecture": cfg.architecture, "parameters": parameter_count(cfg),
                  "layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
                  "intermediate_size": cfg.intermediate_size,
                  "attention_heads": cfg.num_attention_heads,
                  "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
                  "vocab_size": cfg.vocab_size, "context_length": cfg.max_position_embeddings,
                  "tied_embeddings": cfg.tie_word_embeddings, **model_card(source, tok)},
        "runtime": {"device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch."),
                    "quantization": engine.quantization or "none",
                    "max_model_len": engine.max_model_len,
                    "kv_blocks": engine.block_manager.num_blocks,
                    "block_size": engine.config.block_size},
        "tokenizer": {"vocab_size": tok.vocab_size, "bos_token_id": tok.bos_token_id,
                      "eos_token_ids": sorted(tok.eos_token_ids)},
        "cache": {"home": str(formcast_home()), "files": cache_files(source.path)},
        "versions": versions(),
    }
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    out = Console(highlight=False)
    for section, rows in report.items():
        table = Table(title=section, title_justify="left", show_header=False, box=None,
                      padding=(0, 2))
        table.add_column(style="bold")
        table.add_column(overflow="fold")
        for key, value in rows.items():
            if isinstance(value, list):
                value = "\n".join(map(str, value)) or "-"
            table.add_row(key, f"{value:,}" if isinstance(value, int) and not isinstance(
                value, bool) else str(value))
        out.print(table)
        out.print()


# -- generate -----------------------------------------------------------------------
@app.command()
def generate(
    ctx: typer.Context,
    prompt: Annotated[str, typer.Argument(help="The prompt ('-' reads stdin).")],
    regex: Annotated[str | None, typer.Option(help="Output must fully match this regex.")] = None,
    json_schema: Annotated[str | None, typer.Option(
        "--json-schema", help="JSON Schema file (or inline JSON) the output must satisfy.")] = None,
    grammar: Annotated[Path | None, typer.Option(
        help="EBNF (GBNF) grammar file with a root rule.")] = None,
    lark: Annotated[Path | None, typer.Option(help="Lark grammar file.")] = None,
    choices: Annotated[str | None, typer.Option(help="Comma-separated allowed outputs.")] = None,
    max_tokens: Annotated[int, typer.Option(min=1)] = 256,
    temperature: Annotated[float, typer.Option(min=0.0)] = 0.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0)] = 1.0,
    seed: int | None = None,
    system: Annotated[str | None, typer.Option(help="System message.")] = None,
    model: ModelOpt = "smollm2", device: DeviceOpt = "auto", dtype: DtypeOpt = None,
    quantization: QuantOpt = None,
) -> None:
    """Generate text, optionally constrained (at most one of the constraint options)."""
    given = [name for name, v in (("--regex", regex), ("--json-schema", json_schema),
                                  ("--grammar", grammar), ("--lark", lark),
                                  ("--choices", choices)) if v is not None]
    if len(given) > 1:
        raise typer.BadParameter(f"give at most one constraint, got {' and '.join(given)}")
    constraint: dict[str, Any] = {}
    if regex is not None:
        constraint["regex"] = regex
    elif json_schema is not None:
        constraint["json_schema"] = read_json_schema(json_schema, "--json-schema")
    elif grammar is not None:
        constraint["grammar"] = read_text(grammar, "--grammar")
    elif lark is not None:
        constraint["lark"] = read_text(lark, "--lark")
    elif choices is not None:
        options = [c.strip() for c in choices.split(",") if c.strip()]
        if not options:
            raise typer.BadParameter("no choices given", param_hint="--choices")
        constraint["choices"] = options
    if prompt == "-":
        prompt = sys.stdin.read()
    with _errors_to_exit_codes():
        output_spec(**constraint).check()  # (a bad constraint fails before the model loads)
        llm = _load_llm(ctx, model, device, dtype, quantization)
        out = llm.generate(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                           seed=seed, system=system, **constraint)
    typer.echo(out.text)
    u = out.usage
    rate = u.completion_tokens / u.latency_s if u.latency_s > 0 else 0.0
    _err().print(f"[dim]{u.prompt_tokens} prompt + {u.completion_tokens} completion tokens, "
                 f"{u.latency_s:.2f} s ({rate:.1f} tok/s), finish={out.finish_reason}[/dim]")


# -- extract ------------------------------------------------------------------------
@app.command()
def extract(
    ctx: typer.Context,
    schema: Annotated[str, typer.Option(
        help="JSON Schema file (*.json), or module:Class / file.py:Class for a pydantic "
             "model, dataclass or TypedDict.")],
    input: Annotated[Path, typer.Option(
        "--input", "-i", help="JSONL: one string, or one object with a text field, a line.")],
    output: Annotated[Path, typer.Option("--output", "-o",
                                         help="JSONL written here ('-': stdout).")],
    text_field: Annotated[str, typer.Option(
        help="Field holding the text in object lines.")] = "text",
    batch_size: Annotated[int, typer.Option(min=1, help="Texts per engine batch.")] = 16,
    instructions: Annotated[str | None, typer.Option(help="Extra guidance for the model.")] = None,
    max_tokens: Annotated[int | None, typer.Option(min=1)] = None,
    temperature: Annotated[float, typer.Option(min=0.0)] = 0.0,
    seed: int | None = None,
    model: ModelOpt = "smollm2", device: DeviceOpt = "auto", dtype: DtypeOpt = None,
    quantization: QuantOpt = None,
) -> None:
    """Extract one typed object per input text into a JSONL file.

    Each output line is {"index": i, "data": {...}} or, for an item that failed,
    {"index": i, "error": {"type": ..., "message": ...}} (plus "text", the raw
    output, when there is one). The run goes on past failed items.
    """
    target = load_schema(schema)
    texts = read_texts(input, text_field)
    try:  # before loading the model, so a bad path fails fast
        sink = sys.stdout if str(output) == "-" else output.open("w", encoding="utf-8")
    except OSError as exc:
        raise typer.BadParameter(f"cannot write {output}: {exc.strerror or exc}",
                                 param_hint="--output")
    with _errors_to_exit_codes():
        try:
            # (a bad schema or type fails before the model loads, as generate's constraint)
            extraction_spec(target).check()
            llm = _load_llm(ctx, model, device, dtype, quantization)
            failed, tokens = _extract_all(llm, texts, target, sink, batch_size=batch_size,
                                          instructions=instructions, max_tokens=max_tokens,
                                          temperature=temperature, seed=seed)
        finally:
            if sink is not sys.stdout:
                sink.close()
    where = "stdout" if str(output) == "-" else str(output)
    _err().print(f"{len(texts) - failed}/{len(texts)} extracted, {failed} failed, "
                 f"{tokens} output tokens -> {where}")


class _RateColumn(ProgressColumn):
    """Items/s and tokens/s over the whole run so far."""

    def render(self, task: Task) -> Text:
        elapsed = task.elapsed or 0.0
        if elapsed <= 0:
            return Text("-- items/s -- tok/s", style="progress.data.speed")
        tokens = task.fields.get("tokens", 0)
        return Text(f"{task.completed / elapsed:.2f} items/s {tokens / elapsed:.0f} tok/s",
                    style="progress.data.speed")


def _extract_all(llm: Any, texts: list[str], target: Any, sink: Any, *, batch_size: int,
                 **options: Any) -> tuple[int, int]:
    """Run ``extract_batch`` chunk by chunk, writing lines as chunks finish (changes ``sink``).

    Returns the number of failed items and of generated tokens (failed items' too).
    """
    from pydantic_core import to_jsonable_python

    failed = tokens = 0
    columns = (SpinnerColumn(), TextColumn("extract"), BarColumn(bar_width=24),
               MofNCompleteColumn(), _RateColumn(), TimeElapsedColumn())
    with Progress(*columns, console=_err(), transient=False) as progress:
        task = progress.add_task("extract", total=len(texts), tokens=0)
        for start in range(0, len(texts), batch_size):
            chunk = texts[start:start + batch_size]
            seed = options["seed"]
            results = llm.extract_batch(chunk, target, return_completions=True, **{
                **options, "seed": None if seed is None else seed + start})
            for offset, value in enumerate(results):
                line: dict[str, Any] = {"index": start + offset}
                if isinstance(value, FormcastError):
                    failed += 1
                    line["error"] = {"type": type(value).__name__, "message": str(value)}
                    raw = getattr(value, "text", None)
                    if raw:
                        line["error"]["text"] = raw
                        tokens += len(llm.tokenizer.encode(raw, add_special_tokens=False))
                else:
                    line["data"] = to_jsonable_python(value.value)
                    tokens += value.usage.completion_tokens
                sink.write(json.dumps(line, ensure_ascii=False) + "\n")
            sink.flush()
            progress.update(task, advance=len(chunk), tokens=tokens)
    return failed, tokens


# -- dataset ------------------------------------------------------------------------
@app.command()
def dataset(
    ctx: typer.Context,
    schema: Annotated[str, typer.Option(
        help="JSON Schema file (*.json), or module:Class / file.py:Class.")],
    n: Annotated[int, typer.Option("--n", "-n", min=1, help="Records to generate.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="JSONL written (or resumed).")],
    prompts: Annotated[Path | None, typer.Option(
        help="JSONL of prompts: strings, or objects with prompt (and id).")] = None,
    template: Annotated[str | None, typer.Option(
        help="Jinja template (text, or a file holding it) filled from --vars.")] = None,
    vars: Annotated[Path | None, typer.Option(
        "--vars", help="JSON object of name -> list of values (every combination), or a "
                       "JSON list / JSONL of objects (one prompt each).")] = None,
    seed: int = 0,
    temperature: Annotated[float, typer.Option(min=0.0)] = 0.8,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0)] = 1.0,
    max_tokens: Annotated[int, typer.Option(min=1)] = 256,
    batch_size: Annotated[int, typer.Option(min=1, help="Records per engine batch.")] = 8,
    dedupe: Annotated[bool, typer.Option(help="Redraw records equal to an earlier one.")] = True,
    max_attempts: Annotated[int, typer.Option(min=1, help="Draws per record.")] = 10,
    overwrite: Annotated[bool, typer.Option(
        help="Start over instead of resuming an existing output.")] = False,
    system: Annotated[str | None, typer.Option(help="System message.")] = None,
    model: ModelOpt = "smollm2", device: DeviceOpt = "auto", dtype: DtypeOpt = None,
    quantization: QuantOpt = None,
) -> None:
    """Generate N schema-valid records into a JSONL file; rerun the same command to resume.

    Each line is {"id", "data", "prompt_id", "seed", "model", "formcast_version"}.
    A manifest (out.manifest.json) refuses a resume with other parameters; the summary
    (out.summary.json) has counts and per-field distributions.
    """
    from formcast import dataset as ds

    target = load_schema(schema)
    if template is not None and Path(template).is_file():
        template = read_text(Path(template), "--template")
    variables = read_vars(vars) if vars is not None else None
    try:  # fail on bad prompts before loading the model
        ds.build_prompts(prompts=prompts, template=template, variables=variables)
    except (ValueError, OSError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--prompts/--template/--vars")
    with _errors_to_exit_codes():
        extraction_spec(target).check()  # (a bad schema fails before the model loads)
        llm = _load_llm(ctx, model, device, dtype, quantization)
        columns = (SpinnerColumn(), TextColumn("dataset"), BarColumn(bar_width=20),
                   MofNCompleteColumn(), DatasetRateColumn(), TimeElapsedColumn())
        with Progress(*columns, console=_err(), transient=False) as bar:
            task = bar.add_task("dataset", total=n, progress=None)
            summary = ds.generate(
                llm, target, n=n, output=output, prompts=prompts, template=template,
                variables=variables, seed=seed, temperature=temperature, top_p=top_p,
                max_tokens=max_tokens, dedupe=dedupe, batch_size=batch_size,
                resume=not overwrite, max_attempts=max_attempts, system=system,
                progress=lambda p: bar.update(task, completed=p.done, progress=p))
    print_dataset_summary(_err(), summary)


# -- eval ---------------------------------------------------------------------------
@app.command("eval")
def eval_command(
    ctx: typer.Context,
    task: Annotated[Path, typer.Argument(help="Task JSONL: prompt, answer and one of choices, "
                                              "regex, json_schema, grammar, lark per line.")],
    report: Annotated[Path, typer.Option(help="JSON report written here.")],
    plot: Annotated[Path | None, typer.Option(
        help="PNG of accuracy by mode and confusion matrices (needs formcast[plot]).")] = None,
    modes: Annotated[str, typer.Option(
        help="Comma-separated: constrained, score, unconstrained.")] = "constrained,score,"
                                                                      "unconstrained",
    max_tokens: Annotated[int, typer.Option(min=1, help="For items without their own.")] = 48,
    length_normalize: Annotated[bool, typer.Option(
        help="Score mode ranks choices by log-probability per token.")] = False,
    batch_size: Annotated[int, typer.Option(min=1)] = 16,
    model: ModelOpt = "smollm2", device: DeviceOpt = "auto", dtype: DtypeOpt = None,
    quantization: QuantOpt = None,
) -> None:
    """Evaluate a model on a task: constrained, choice-scored and unconstrained accuracy."""
    from formcast.eval_plot import plot_report, require_matplotlib
    from formcast.eval_task import load_task
    from formcast.evaluation import MODES, evaluate

    chosen = [m.strip() for m in modes.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in MODES]
    if unknown or not chosen:
        raise typer.BadParameter(f"unknown mode(s) {', '.join(unknown) or '(none)'}; choose "
                                 f"from {', '.join(MODES)}", param_hint="--modes")
    if plot is not None:
        try:
            require_matplotlib()
        except ModuleNotFoundError as exc:
            raise typer.BadParameter(str(exc), param_hint="--plot")
    try:
        items = load_task(task)  # a malformed task fails before the model loads
    except (ValueError, OSError) as exc:
        raise typer.BadParameter(str(exc), param_hint="TASK")
    with _errors_to_exit_codes():
        check_task_constraints(items)
        llm = _load_llm(ctx, model, device, dtype, quantization)
        columns = (SpinnerColumn(), TextColumn("{task.description:13s}"), BarColumn(bar_width=20),
                   MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=_err(), transient=False) as bar:
            tasks: dict[str, Any] = {}

            def advance(mode: str, done: int, total: int) -> None:
                if mode not in tasks:
                    tasks[mode] = bar.add_task(mode, total=total)
                bar.update(tasks[mode], completed=done)

            result = evaluate(llm, task, modes=chosen, max_tokens=max_tokens,
                              length_normalize=length_normalize, batch_size=batch_size,
                              progress=advance)
        data = result.to_dict()
        report.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n",
                          encoding="utf-8")
        if plot is not None:
            plot_report(data, plot)
    print_eval_summary(Console(highlight=False), _err(), data, report, plot)


def main() -> None:
    """Entry point of ``python -m formcast``."""
    app(prog_name="formcast")


if __name__ == "__main__":
    main()
