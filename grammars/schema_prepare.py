"""JSON Schema front end: validate, report coverage, rewrite for a backend, build the end check.

The pipeline: parse and metaschema-check with the schema's own draft
(:mod:`schema_drafts` rewrites it into 2020-12 form), classify every keyword
(:mod:`schema_coverage`), resolve references (:mod:`schema_refs`), refuse what no
document satisfies (:mod:`schema_satisfiable`), then rewrite it for the backend
(:mod:`schema_rewrite`). The end check validates the caller's original schema with
the validator of its draft whenever the mask enforces less than the schema says.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from jsonschema.exceptions import SchemaError, best_match

from formcast.grammars.constraints import JsonSchema
from formcast.grammars.errors import ConstraintError
from formcast.grammars.json_spans import value_span
from formcast.grammars.end_violation import EndViolation
from formcast.grammars.metaschema import check_schema
from formcast.grammars.native_log import native_log
from formcast.grammars.schema_coverage import (
    ANNOTATIONS, PROFILES, KeywordCoverage, SchemaCoverage, analyze, pointer_join,
)
from formcast.grammars.schema_drafts import Normalised, draft_of, normalise
from formcast.grammars.schema_patterns import with_python_patterns
from formcast.grammars.schema_refs import resolve_refs
from formcast.grammars.schema_rewrite import Rewriter
from formcast.grammars.schema_satisfiable import Inhabitation, check_root

MAX_SCHEMA_BYTES = 8 << 20    # real schemas reach ~1.4 MB (renovate)
MAX_SCHEMA_DEPTH = 128      # JSON nesting levels; deeper schemas are refused


@dataclass(frozen=True, kw_only=True)
class PreparedSchema:
    """A schema ready for one backend."""

    text: str                                    # the rewritten schema, JSON
    coverage: SchemaCoverage
    end_check: Callable[[bytes], EndViolation | None] | None


def load_schema(constraint: JsonSchema) -> Normalised:
    """Parse, depth- and metaschema-check the schema, in 2020-12 form.

    Raises
    ------
    ConstraintError
        Unparseable, too large, too deep or not a valid schema of its draft (with the
        location).
    """
    try:
        text = constraint.schema_text
    except ValueError as exc:
        raise ConstraintError(str(exc)) from None
    except RecursionError:
        raise ConstraintError("the schema is nested too deeply to read") from None
    if len(text.encode("utf-8")) > MAX_SCHEMA_BYTES:
        raise ConstraintError(f"the schema is {len(text)} characters; at most "
                              f"{MAX_SCHEMA_BYTES} bytes are accepted")
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConstraintError(f"the schema is not valid JSON: {exc.msg} at line "
                              f"{exc.lineno}:{exc.colno}") from None
    except RecursionError:
        raise ConstraintError("the schema is nested too deeply to parse") from None
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError("a JSON Schema is an object or a boolean, got "
                              f"{type(schema).__name__}")
    _check_depth(schema)
    # ECMA-262 spellings Python's re cannot read (\p{L}, surrogate pairs) become Python's
    schema = with_python_patterns(schema)
    _, validator = draft_of(schema)
    declared = isinstance(schema, dict) and "$schema" in schema
    try:
        if declared:
            check_schema(schema, validator)
        normalised = normalise(schema)
        if not declared:
            check_schema(normalised.schema, validator)
    except SchemaError as exc:
        where = pointer_join("#", *exc.path)
        raise ConstraintError(f"{where}: invalid JSON Schema: {exc.message}") from None
    except (TypeError, AttributeError):   # malformed beyond what normalise can read
        try:
            check_schema(schema, validator)
        except SchemaError as exc:
            where = pointer_join("#", *exc.path)
            raise ConstraintError(f"{where}: invalid JSON Schema: {exc.message}") from None
        raise ConstraintError("#: invalid JSON Schema") from None
    return normalised


def _check_depth(schema: Any) -> None:
    stack: list[tuple[Any, int, str]] = [(schema, 0, "#")]
    while stack:
        node, depth, pointer = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise ConstraintError(f"{pointer}: the schema is nested more than "
                                  f"{MAX_SCHEMA_DEPTH} levels deep")
        if isinstance(node, dict):
            stack.extend((v, depth + 1, pointer_join(pointer, k)) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, depth + 1, pointer_join(pointer, i)) for i, v in enumerate(node))


def explain(schema: dict | bool | str, *, backend: str = "xgrammar",
            strict: bool = True) -> SchemaCoverage:
    """Report, keyword by keyword, how a JSON Schema is enforced. Does not change state.

    Parameters
    ----------
    schema : dict, bool or str
        The JSON Schema (or its JSON text).
    backend : {"xgrammar", "outlines-core"}
        The mask backend the report is for.
    strict : bool
        As :class:`JsonSchema`'s ``strict``: objects closed unless they say otherwise.

    Returns
    -------
    SchemaCoverage
        One entry per keyword: ``mask`` (enforced by the token mask), ``end`` (checked
        on the finished document; the stop token is refused until it validates),
        ``annotation`` (constrains nothing; unknown keywords and formats, noted
        "ignored") or ``unsupported`` (compiling it raises ConstraintError); and
        ``warnings``, what the mask library says when it builds the grammar (as
        :attr:`CompiledGrammar.warnings` lists them).

    Raises
    ------
    ConstraintError
        If the schema is malformed or unsatisfiable (with a JSON pointer).
    """
    if backend not in PROFILES:
        raise ValueError(f"unknown backend {backend!r}; choose from {sorted(PROFILES)}")
    prepared = prepare(JsonSchema(schema, strict=strict), backend, refuse=False)
    if backend != "xgrammar" or prepared.coverage.with_status("unsupported"):
        return prepared.coverage
    return replace(prepared.coverage, warnings=(*prepared.coverage.warnings,
                                                *_xgrammar_warnings(prepared.text)))


def _xgrammar_warnings(text: str) -> tuple[str, ...]:
    """What xgrammar logs while it builds the grammar of a prepared schema (its
    warnings come from reading the schema, before any vocabulary is involved)."""
    import xgrammar as xgr     # only explain() for xgrammar needs it here

    with native_log().capture() as logged:
        try:
            xgr.Grammar.from_json_schema(text, any_whitespace=False, separators=(",", ":"),
                                         strict_mode=True)
        except RuntimeError as exc:
            raise ConstraintError(f"json_schema: {exc}") from None
    return tuple(dict.fromkeys(f"xgrammar: {line}" for line in logged))


def prepare(constraint: JsonSchema, backend: str, *, refuse: bool = True) -> PreparedSchema:
    """Validate, analyse and rewrite a schema for ``backend``.

    Raises
    ------
    ConstraintError
        Malformed, unsatisfiable, or (``refuse``) using keywords the backend cannot
        enforce.
    """
    try:
        return _prepare(constraint, backend, refuse)
    except RecursionError:
        raise ConstraintError("#: the schema is nested too deeply") from None


def _prepare(constraint: JsonSchema, backend: str, refuse: bool) -> PreparedSchema:
    normalised = load_schema(constraint)
    schema = normalised.schema
    if backend == "outlines-core" and (schema is True or (
            isinstance(schema, dict) and not set(schema) - ANNOTATIONS)):
        # Measured: its index for "any JSON value" takes ~50 s on a 300-token vocabulary.
        raise ConstraintError("#: the outlines-core backend cannot compile an unconstrained "
                              "document ({} or true) in reasonable time; use xgrammar")
    coverage = analyze(schema, backend, strict=constraint.strict)
    bad = coverage.with_status("unsupported")
    if bad and refuse:
        listed = "; ".join(f"{i.pointer}/{i.keyword}" + (f" ({i.note})" if i.note else "")
                           for i in bad)
        raise ConstraintError(f"the schema uses keywords formcast cannot enforce with the "
                              f"{backend} backend: {listed}")
    resolved = resolve_refs(schema)
    analysis = Inhabitation(resolved)
    check_root(resolved, analysis)
    rewriter = Rewriter(root=resolved, analysis=analysis, strict=constraint.strict,
                        profile=PROFILES[backend])
    rewritten = rewriter.run()
    coverage = _final_coverage(coverage, normalised, rewriter.lossy)
    end_check = _end_check(normalised) if coverage.needs_end_check else None
    return PreparedSchema(text=json.dumps(rewritten, ensure_ascii=False), coverage=coverage,
                          end_check=end_check)


def _final_coverage(coverage: SchemaCoverage, normalised: Normalised,
                    lossy: dict[tuple[str, str], str]) -> SchemaCoverage:
    """The analysis, plus ignored keywords and what the rewrite had to widen."""
    items = []
    for item in coverage.items:
        note = lossy.pop((item.pointer, item.keyword), None)
        if note is not None and item.status == "mask":
            item = replace(item, status="end", note=note)
        items.append(item)
    items += [KeywordCoverage(pointer=p, keyword=k, status="end", note=n)
              for (p, k), n in lossy.items()]
    items += [KeywordCoverage(pointer=p, keyword=k, status="annotation", note=n)
              for p, k, n in normalised.ignored]
    typos = tuple(dict.fromkeys(f"JSON Schema keyword {k!r} is unknown and ignored; "
                                f"{n.split('; ', 1)[1]}" for _, k, n in normalised.ignored
                                if "did you mean" in n))
    return SchemaCoverage(backend=coverage.backend, items=tuple(items), warnings=typos)


# Failures fixed by adding to a container: redo only its closing bracket.
_MISSING = frozenset({"required", "dependentRequired", "minProperties", "minItems", "contains",
                      "minContains"})


def _end_check(normalised: Normalised) -> Callable[[bytes], EndViolation | None]:
    cls = normalised.validator
    validator = cls(normalised.original, format_checker=cls.FORMAT_CHECKER)

    def check(data: bytes) -> EndViolation | None:
        try:
            text = data.decode("utf-8")
            value = json.loads(text)
        except ValueError as exc:
            return EndViolation(f"not one JSON document: {exc}", 0)
        error = best_match(validator.iter_errors(value))
        if error is None:
            return None
        path = list(error.absolute_path)
        if error.validator == "uniqueItems" and isinstance(error.instance, list):
            path.append(_first_duplicate(error.instance))
        try:
            start, end = value_span(text, path)
        except ValueError:
            start, end = 0, len(text)
        if error.validator in _MISSING and isinstance(error.instance, (dict, list)):
            start = end - 1
        return EndViolation(f"{error.json_path}: {error.message}",
                            len(text[:start].encode("utf-8")))

    return check


def _first_duplicate(items: list) -> int:
    for j in range(1, len(items)):
        if any(items[j] == items[i] and type(items[j]) is type(items[i]) for i in range(j)):
            return j
    return 0
