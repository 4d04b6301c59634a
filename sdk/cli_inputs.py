"""What the command line reads: texts, JSON Schemas, schema classes and variables.

Each reader turns a bad file or value into ``typer.BadParameter`` naming the
option, which the CLI reports as a usage error.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import typer

from formcast.errors import ConstraintError
from formcast.spec import output_spec


def read_text(path: Path, hint: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc.strerror or exc}", param_hint=hint)


def read_json_schema(value: str, hint: str) -> dict:
    inline = not Path(value).is_file() and value.lstrip()[:1] in ("{", "[")
    text = value if inline else read_text(Path(value), hint)
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"not valid JSON: {exc}", param_hint=hint)
    if not isinstance(schema, dict):
        raise typer.BadParameter("a JSON Schema must be a JSON object", param_hint=hint)
    return schema


def read_texts(path: Path, field: str) -> list[str]:
    """The texts of a JSONL file; a malformed line is a usage error naming its number."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc.strerror or exc}", param_hint="--input")
    texts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise typer.BadParameter(f"{path}:{number} is not JSON: {exc.msg}",
                                     param_hint="--input")
        if isinstance(item, dict) and isinstance(item.get(field), str):
            item = item[field]
        if not isinstance(item, str):
            raise typer.BadParameter(f"{path}:{number} is neither a string nor an object with a "
                                     f"string {field!r} field", param_hint="--input")
        texts.append(item)
    if not texts:
        raise typer.BadParameter(f"{path} holds no texts", param_hint="--input")
    return texts


def load_schema(spec: str) -> Any:
    """A JSON Schema dict from a .json file, or a class (``module:Class``, ``file.py:Class``)."""
    if spec.endswith(".json") or (":" not in spec and Path(spec).exists()):
        return read_json_schema(str(Path(spec)), "--schema")
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise typer.BadParameter(f"{spec!r} is neither a .json file nor module:Class",
                                 param_hint="--schema")
    try:
        if module_name.endswith(".py"):
            module = import_file(Path(module_name))
        else:
            if "" not in sys.path:  # as `python -m` does, so a module next to the data imports
                sys.path.insert(0, "")
            module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module: anything it raises is their usage error
        raise typer.BadParameter(f"cannot import {module_name}: {type(exc).__name__}: {exc}",
                                 param_hint="--schema")
    target: Any = module
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise typer.BadParameter(f"{module_name} has no attribute {attr!r}",
                                     param_hint="--schema")
    if not isinstance(target, type):
        raise typer.BadParameter(f"{spec} is not a class", param_hint="--schema")
    return target


def import_file(path: Path) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"no such file {path}")
    name = f"formcast_user_schema_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pydantic look their module up by name
    spec.loader.exec_module(module)
    return module


def read_vars(path: Path) -> Any:
    text = read_text(path, "--vars")
    try:
        if path.suffix == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"{path} is not valid JSON: {exc}", param_hint="--vars")


def check_task_constraints(items: list[Any]) -> None:
    """Each distinct constraint of a task, checked before the model loads.

    Raises
    ------
    ConstraintError
        The first bad constraint, with the id of the item holding it.
    """
    seen: set[str] = set()
    for item in items:
        if item.constraint_key in seen:
            continue
        seen.add(item.constraint_key)
        try:
            output_spec(**{item.kind: item.constraint}).check()
        except ConstraintError as exc:
            raise ConstraintError(f"task item {item.id!r}: {exc}") from None
