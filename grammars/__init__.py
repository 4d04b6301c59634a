"""formcast.grammars: constraints compiled into token-mask matchers.

A constraint (:class:`Regex`, :class:`JsonSchema`, :class:`Ebnf`, :class:`Lark`,
:class:`Choice`, or :func:`from_type` of a Python type) is compiled for a tokenizer
into an immutable :class:`CompiledGrammar`; each request gets a cheap
:class:`Matcher` from it, which implements the engine's ``LogitsConstraint``::

    from formcast.engine import load_tokenizer
    from formcast import grammars

    tok = load_tokenizer("smollm2")
    compiled = grammars.compile(grammars.from_type(Person), tok)
    matcher = compiled.matcher()          # hand to Engine.generate(..., constraints=[...])
"""

from formcast.grammars.bitmask import allocate_bitmask, apply_bitmask, fill_bitmasks
from formcast.grammars.compiler import (
    BACKENDS,
    CompiledGrammar,
    GrammarCompiler,
    compile,
    default_compiler,
)
from formcast.grammars.constraints import Choice, Constraint, Ebnf, JsonSchema, Lark, Regex
from formcast.grammars.matcher import EndCheckedMatcher, EndViolation, Matcher
from formcast.grammars.python_types import from_type, type_schema
from formcast.grammars.schema_coverage import KeywordCoverage, SchemaCoverage
from formcast.grammars.schema_prepare import explain
from formcast.grammars.vocab import Vocabulary

__all__ = [
    "BACKENDS",
    "Choice",
    "CompiledGrammar",
    "Constraint",
    "Ebnf",
    "EndCheckedMatcher",
    "EndViolation",
    "GrammarCompiler",
    "JsonSchema",
    "KeywordCoverage",
    "Lark",
    "Matcher",
    "Regex",
    "SchemaCoverage",
    "Vocabulary",
    "allocate_bitmask",
    "apply_bitmask",
    "compile",
    "default_compiler",
    "explain",
    "fill_bitmasks",
    "from_type",
    "type_schema",
]
