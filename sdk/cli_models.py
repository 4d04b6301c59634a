"""``formcast models``: the models formcast can fetch by name, with size and licence."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from formcast.catalog import catalog


def models_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List the models formcast can fetch by name (formcast pull NAME), with size and licence."""
    entries = catalog()
    if as_json:
        typer.echo(json.dumps([m.to_dict() for m in entries], indent=2))
        return
    table = Table(box=None, padding=(0, 2), header_style="bold")
    for column in ("name", "model", "size", "licence", "kind", "cached"):
        table.add_column(column, no_wrap=column in ("name", "size"), overflow="fold")
    for m in entries:
        table.add_row(m.name, m.title, f"{m.size / 2**20:.0f} MiB", m.licence,
                      "instruct" if m.instruct else "base", "yes" if m.cached else "no")
    out = Console(highlight=False)
    out.print(table)
    out.print("Fetch one with `formcast pull NAME`, load it with formcast.load(NAME). A base "
              "model continues text: prompt it completion style (raw=True).")
