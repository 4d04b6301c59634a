"""From a call's constraint arguments to a grammar constraint and an output parser.

``output_spec`` takes the keyword arguments of ``LLM.generate`` (at most one set)
and returns an :class:`OutputSpec`: the ``formcast.grammars`` constraint to compile,
and how to turn the finished text into a value (JSON parsing + validation with an
independent validator: jsonschema or pydantic).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from formcast.errors import ConstraintError, OutputValidationError


@dataclass(frozen=True, kw_only=True)
class OutputSpec:
    """What the output must be, and how to read it.

    Attributes
    ----------
    kind : str
        "text", "regex", "json", "grammar", "lark", "choice" or "type".
    constraint : object | None
        The ``formcast.grammars`` constraint (None for free text).
    parser : callable | None
        text -> value; raises :class:`OutputValidationError`. None: no value.
    json_schema : dict | bool | None
        The JSON Schema, for JSON outputs.
    """

    kind: str
    constraint: Any = None
    parser: Callable[[str], Any] | None = None
    json_schema: dict | bool | None = None

    @property
    def parses(self) -> bool:
        return self.parser is not None

    def parse(self, text: str) -> Any:
        assert self.parser is not None
        return self.parser(text)

    def check(self) -> None:
        """Validate the constraint without a tokenizer, so that a command line or a
        server refuses it before loading a model (no state change).

        Raises
        ------
        ConstraintError
            Invalid regex or JSON Schema, unsatisfiable schema, a grammar that does
            not parse or derives no string.
        """
        if self.constraint is None:
            return
        # (the front end imports no torch: a bad regex or schema fails before any load)
        from formcast.grammars.grammar_check import check_grammar
        from formcast.grammars.source import grammar_source

        source, _, _ = grammar_source(self.constraint, "xgrammar")
        if source.kind in ("ebnf", "lark"):
            import xgrammar

            try:
                if source.kind == "ebnf":
                    xgrammar.Grammar.from_ebnf(source.text, root_rule_name=source.root)
                else:
                    xgrammar.Grammar.from_lark(source.text)
            except RuntimeError as exc:
                raise ConstraintError(f"invalid {source.kind} grammar: {exc}") from None
        check_grammar(source)

    def compile(self, tokenizer: Any, *, vocab_size: int):
        """The compiled grammar (cached by the grammar layer), or None for free text."""
        if self.constraint is None:
            return None
        from formcast import grammars

        return grammars.compile(self.constraint, tokenizer, vocab_size=vocab_size)


def output_spec(*, regex: str | None = None, json_schema: dict | str | None = None,
                grammar: str | None = None, lark: str | None = None,
                choices: Sequence[str] | None = None, output_type: Any = None) -> OutputSpec:
    """Build the spec for at most one constraint argument.

    Raises
    ------
    ConstraintError
        More than one constraint given, or one that is malformed (JSON Schema text
        that does not parse, choices that are not distinct strings, ...).
    """
    given = {k: v for k, v in dict(regex=regex, json_schema=json_schema, grammar=grammar,
                                   lark=lark, choices=choices, output_type=output_type).items()
             if v is not None}
    if len(given) > 1:
        raise ConstraintError(f"give at most one constraint, got {sorted(given)}")
    if not given:
        return OutputSpec(kind="text")
    from formcast import grammars

    (key, value), = given.items()
    if key == "regex":
        return OutputSpec(kind="regex", constraint=grammars.Regex(value))
    if key == "grammar":
        return OutputSpec(kind="grammar", constraint=grammars.Ebnf(value))
    if key == "lark":
        return OutputSpec(kind="lark", constraint=grammars.Lark(value))
    if key == "choices":
        options = value if isinstance(value, (str, Sequence)) else _listed(value)
        return OutputSpec(kind="choice", constraint=grammars.Choice(options),
                          parser=lambda text: _check_choice(text, options))
    if key == "json_schema":
        schema = _schema_value(value)
        return OutputSpec(kind="json", constraint=grammars.JsonSchema(schema),
                          parser=lambda text: parse_json(text, schema), json_schema=schema)
    return type_spec(value)


def _schema_value(value: Any) -> Any:
    """A ``json_schema=`` argument as a dict or bool (JSON text parsed)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConstraintError(f"json_schema is not valid JSON: {exc.msg} at line "
                                  f"{exc.lineno}:{exc.colno}") from None
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, bool):
        return value
    raise ConstraintError("json_schema must be a dict, a bool or JSON text, "
                          f"got {type(value).__name__}")


def _listed(value: Any) -> Any:
    """Choices given as any iterable, as a list (a non-iterable is left for Choice to refuse)."""
    try:
        return list(value)
    except TypeError:
        return value


def type_spec(tp: Any) -> OutputSpec:
    """Spec for a Python type: JSON constrained by its schema, validated by pydantic.

    Where pydantic cannot adapt the type (``typing.TypedDict`` before Python 3.12),
    the value is validated with jsonschema against the same schema and returned as
    plain JSON data.
    """
    from formcast import grammars

    constraint = grammars.from_type(tp)   # TypeError naming the type if unsupported
    schema = grammars.type_schema(tp)
    try:
        from pydantic import TypeAdapter

        adapter = TypeAdapter(tp)
    except Exception:  # pydantic refuses some types it cannot rebuild; jsonschema still can
        return OutputSpec(kind="type", constraint=constraint,
                          parser=lambda text: parse_json(text, schema), json_schema=schema)
    return OutputSpec(kind="type", constraint=constraint,
                      parser=lambda text: validate_with(adapter, text), json_schema=schema)


def validate_with(adapter: Any, text: str) -> Any:
    from pydantic import ValidationError

    try:
        return adapter.validate_json(text)
    except ValidationError as exc:
        raise OutputValidationError(f"the output does not validate: {exc}", text=text,
                                    error=exc) from exc


def parse_json(text: str, schema: dict) -> Any:
    """json.loads + jsonschema validation, both independent of the mask backend."""
    import jsonschema

    try:
        value = json.loads(text)
        jsonschema.validate(value, schema)
    except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
        raise OutputValidationError(f"the output does not validate: {exc}", text=text,
                                    error=exc) from exc
    return value


def _check_choice(text: str, options: list[str]) -> str:
    if text not in options:
        raise OutputValidationError(f"{text!r} is not one of the choices", text=text,
                                    error=ValueError(text))
    return text
