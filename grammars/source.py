"""The grammar front end: a constraint validated and translated for a backend.

It imports neither torch nor a mask library, so that a command line or a server can
refuse a bad regex or JSON Schema before it loads a model.
"""

from __future__ import annotations

from formcast.grammars import regex_dialect
from formcast.grammars.backends.base import GrammarSource
from formcast.grammars.constraints import Choice, Constraint, Ebnf, JsonSchema, Lark, Regex
from formcast.grammars.end_violation import EndCheck
from formcast.grammars.errors import ConstraintError
from formcast.grammars.schema_coverage import SchemaCoverage
from formcast.grammars.schema_prepare import prepare


def grammar_source(constraint: Constraint, backend: str
                   ) -> tuple[GrammarSource, SchemaCoverage | None, EndCheck | None]:
    """Validate a constraint and translate it for ``backend`` (no state change).

    Parameters
    ----------
    constraint : Constraint
        A :class:`Regex`, :class:`Choice`, :class:`JsonSchema`, :class:`Ebnf` or :class:`Lark`.
    backend : str
        The backend the source is for (JSON Schema preparation depends on it).

    Returns
    -------
    tuple
        The source, the schema coverage (JSON Schema only) and the end check of the
        parts checked on the finished document (None when the mask enforces everything).

    Raises
    ------
    ConstraintError
        An invalid regex or JSON Schema, an unsatisfiable schema, or not a constraint.
    """
    if isinstance(constraint, Regex):
        source = GrammarSource(kind="regex", text=regex_dialect.translate(constraint.pattern))
        return source, None, None
    if isinstance(constraint, Choice):
        alts = "|".join(regex_dialect.literal(o) for o in constraint.options)
        return GrammarSource(kind="regex", text=f"({alts})"), None, None
    if isinstance(constraint, JsonSchema):
        prepared = prepare(constraint, backend)
        source = GrammarSource(kind="json_schema", text=prepared.text,
                               max_whitespace=constraint.whitespace_bound)
        return source, prepared.coverage, prepared.end_check
    if isinstance(constraint, Ebnf):
        return GrammarSource(kind="ebnf", text=constraint.text, root=constraint.root), None, None
    if isinstance(constraint, Lark):
        return GrammarSource(kind="lark", text=constraint.text), None, None
    raise ConstraintError(f"not a formcast constraint: {type(constraint).__name__} "
                          "(use Regex, JsonSchema, Ebnf, Lark, Choice or from_type)")
