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

Names are imported on first use, so that ``formcast.grammars.errors`` loads no torch.
"""

import importlib

_EXPORTS = {
    "BACKENDS": "formcast.grammars.compiler",
    "Choice": "formcast.grammars.constraints",
    "CompiledGrammar": "formcast.grammars.compiler",
    "Constraint": "formcast.grammars.constraints",
    "ConstraintError": "formcast.grammars.errors",
    "UnsupportedTypeError": "formcast.grammars.errors",
    "Ebnf": "formcast.grammars.constraints",
    "EndCheckedMatcher": "formcast.grammars.matcher",
    "EndViolation": "formcast.grammars.end_violation",
    "GrammarCompiler": "formcast.grammars.compiler",
    "Grounded": "formcast.grammars.grounding",
    "GroundedMatcher": "formcast.grammars.grounded_matcher",
    "GroundingPlan": "formcast.grammars.grounding",
    "GroundingViolation": "formcast.grammars.grounded_matcher",
    "NotGrounded": "formcast.grammars.grounding",
    "Repeat": "formcast.grammars.json_tracker",
    "JsonSchema": "formcast.grammars.constraints",
    "KeywordCoverage": "formcast.grammars.schema_coverage",
    "Lark": "formcast.grammars.constraints",
    "Matcher": "formcast.grammars.matcher",
    "Regex": "formcast.grammars.constraints",
    "SchemaCoverage": "formcast.grammars.schema_coverage",
    "Vocabulary": "formcast.grammars.vocab",
    "allocate_bitmask": "formcast.grammars.bitmask",
    "compile": "formcast.grammars.compiler",
    "default_compiler": "formcast.grammars.compiler",
    "explain": "formcast.grammars.schema_prepare",
    "fill_bitmasks": "formcast.grammars.bitmask",
    "from_type": "formcast.grammars.python_types",
    "ground": "formcast.grammars.grounding",
    "grounding_plan": "formcast.grammars.grounding",
    "type_schema": "formcast.grammars.python_types",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'formcast.grammars' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = sorted(_EXPORTS)
