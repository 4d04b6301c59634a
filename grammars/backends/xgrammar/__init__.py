"""The xgrammar backend, the default: compiles regex, JSON Schema, EBNF and Lark.

Modules, one noun each: ``backend`` (compiling grammars), ``matcher``
(:class:`XGrammarMatcher`, one request's state), ``batch_accept`` (a step's
tokens offered to many matchers at once), ``batch_fill`` (many masks filled at
once, one fill per shared state), ``fill_plan`` (one thread or several for a
fill), ``text_masks`` (the masks a grammar's matchers reach on short texts),
``worker_jobs`` and ``native`` (the native accept worker and the jobs it takes),
``ffi`` (what xgrammar and tvm-ffi offer beyond the public API) and ``tuning``
(:class:`XGrammarTuning`, the performance knobs).
"""

from formcast.grammars.backends.xgrammar.backend import XGrammarBackend, XGrammarGrammar
from formcast.grammars.backends.xgrammar.matcher import XGrammarMatcher
from formcast.grammars.backends.xgrammar.tuning import XGrammarTuning

__all__ = ["XGrammarBackend", "XGrammarGrammar", "XGrammarMatcher", "XGrammarTuning"]
