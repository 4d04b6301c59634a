"""What the ``info``, ``dataset`` and ``eval`` commands print: the versions and cache
files, a progress column and the end summaries (rendering only; the numbers come from
formcast.dataset / formcast.evaluation)."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import ProgressColumn, Task
from rich.table import Table
from rich.text import Text

from formcast import __version__


class DatasetRateColumn(ProgressColumn):
    """Records/s, tokens/s, valid share and duplicates of this run."""

    def render(self, task: Task) -> Text:
        p = task.fields.get("progress")
        if p is None or p.elapsed_s <= 0:
            return Text("-- rec/s -- tok/s", style="progress.data.speed")
        drawn = p.valid + p.invalid + p.duplicates
        valid = f"{(drawn - p.invalid) / drawn:.0%}" if drawn else "--"
        return Text(f"{p.valid / p.elapsed_s:.2f} rec/s {p.tokens / p.elapsed_s:.0f} tok/s "
                    f"valid {valid} dup {p.duplicates}", style="progress.data.speed")


def print_dataset_summary(err: Console, summary: Any) -> None:
    """The end-of-run lines of ``formcast dataset``: counts, then a table of fields."""
    resumed = f" ({summary.resumed} found, resumed)" if summary.resumed else ""
    err.print(f"{summary.n} records in {summary.output}{resumed}: {summary.generated} "
              f"generated, {summary.duplicates} duplicates and {summary.invalid} invalid "
              f"draws redrawn, {summary.completion_tokens} tokens, {summary.elapsed_s:.1f} s")
    table = Table(title="fields", title_justify="left", box=None, padding=(0, 2))
    for column in ("field", "type", "distribution"):
        table.add_column(column, overflow="fold")
    for path, entry in summary.fields.items():
        for kind in ("boolean", "integer", "number", "string", "array"):
            if kind in entry:
                table.add_row(path, kind, _describe_field(entry[kind]))
        if entry.get("null"):
            table.add_row(path, "null", f"{entry['null']} of {entry['count']}")
    err.print(table)
    err.print(f"summary -> {summary.summary}")


def _describe_field(section: dict[str, Any]) -> str:
    if "counts" in section and "length" not in section and "mean" not in section:
        return _counts_text(section["counts"])
    parts = []
    if "mean" in section:
        parts.append(f"min {section['min']} max {section['max']} mean {section['mean']:.4g}")
    if "length" in section:
        length = section["length"]
        parts.append(f"{section['distinct']} distinct, length {length['min']}-{length['max']} "
                     f"(mean {length['mean']:.3g})")
    if "counts" in section:
        parts.append(_counts_text(section["counts"]))
    return "; ".join(parts)


def _counts_text(counts: dict[str, int], limit: int = 6) -> str:
    shown = ", ".join(f"{k}: {v}" for k, v in list(counts.items())[:limit])
    return shown + (", ..." if len(counts) > limit else "")


def print_eval_summary(out: Console, err: Console, data: dict[str, Any], report: Path,
                       plot: Path | None) -> None:
    """The accuracy table of ``formcast eval`` (stdout) and where the files went (stderr)."""
    table = Table(title=f"{data['num_items']} items (acc: normalized match; exact: exact match)",
                  title_justify="left", box=None, padding=(0, 1))
    for column in ("mode", "items", "acc", "95% CI", "exact", "invalid", "tokens", "time"):
        table.add_column(column, justify="left" if column == "mode" else "right", no_wrap=True)
    for mode, m in data["modes"].items():
        table.add_row(mode, str(m["items"]), f"{m['accuracy']:.1%}",
                      f"{m['ci95'][0]:.0%}-{m['ci95'][1]:.0%}", f"{m['exact_accuracy']:.1%}",
                      f"{m['invalid_rate']:.1%}",
                      f"{m['prompt_tokens'] + m['completion_tokens']}", f"{m['time_s']:.1f} s")
    out.print(table)
    where = f"report -> {report}" + (f", plot -> {plot}" if plot else "")
    err.print(where)


def cache_files(path: Path) -> list[str]:
    """The cache's files of a model at ``path`` (a folder, or a file and its siblings)."""
    if path.is_dir():
        return [str(path)]
    return [str(p) for p in sorted(path.parent.iterdir()) if p.name.startswith(path.name)]


def versions() -> dict[str, str]:
    """Versions of formcast, Python and the libraries it runs on."""
    from importlib.metadata import PackageNotFoundError, version

    found = {"formcast": __version__, "python": platform.python_version()}
    for dist in ("torch", "tokenizers", "pydantic", "xgrammar", "outlines_core", "typer", "rich"):
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            continue
    return found


def model_card(source: Any, tokenizer: Any) -> dict[str, Any]:
    """``info``'s licence and prompting rows: a registry model's own, else whether the
    file has a chat template (a model without one is prompted completion style)."""
    entry = getattr(source, "entry", None)
    instruct = entry.instruct if entry is not None else tokenizer.chat_template is not None
    card = {"licence": entry.licence} if entry is not None else {}
    card["prompting"] = "chat (instruct)" if instruct else \
        "completion (base model: raw=True, or a plain string)"
    return card


def parameter_count(cfg: Any) -> int:
    """Weights of a Llama decoder, from its shape (true whatever the storage format)."""
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, \
        cfg.num_key_value_heads * cfg.head_dim
    layer = h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size + 2 * h
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    return cfg.vocab_size * h + cfg.num_hidden_layers * layer + h + head
