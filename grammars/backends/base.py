"""The backend interface: a grammar source in, an immutable compiled grammar out.

A backend instance is bound to one :class:`~formcast.grammars.vocab.Vocabulary` (it
keeps whatever per-vocabulary tables its library needs). The front end has already
validated and translated the constraint into a :class:`GrammarSource`, so backends
only compile and make matchers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

if TYPE_CHECKING:  # (both load torch, which the front end's GrammarSource must not)
    from formcast.grammars.matcher import Matcher
    from formcast.grammars.vocab import Vocabulary

SourceKind = Literal["regex", "json_schema", "ebnf", "lark"]


@dataclass(frozen=True, kw_only=True)
class GrammarSource:
    """A constraint after validation, in a form the backends read.

    Attributes
    ----------
    kind : {"regex", "json_schema", "ebnf", "lark"}
    text : str
        A portable regex (see ``regex_dialect``), a prepared JSON Schema as JSON text,
        or grammar text.
    root : str
        Start rule of an EBNF grammar.
    max_whitespace : int
        Whitespace characters allowed between JSON tokens (0: compact).
    """

    kind: SourceKind
    text: str
    root: str = "root"
    max_whitespace: int = 0


class BackendGrammar(ABC):
    """One compiled grammar of a backend; immutable, shared by its matchers."""

    @property
    @abstractmethod
    def memory_bytes(self) -> int:
        """Approximate memory held (what the compile cache charges for it)."""

    @abstractmethod
    def matcher(self) -> Matcher:
        """A fresh matcher at the start of the grammar."""


class Backend(ABC):
    """A token-mask library behind formcast's interface, bound to one vocabulary."""

    name: ClassVar[str]
    kinds: ClassVar[frozenset[str]]

    def __init__(self, vocab: Vocabulary) -> None:
        self.vocab = vocab

    @classmethod
    def supports(cls, kind: str) -> bool:
        """Whether this backend compiles sources of ``kind``."""
        return kind in cls.kinds

    @abstractmethod
    def compile(self, source: GrammarSource) -> BackendGrammar:
        """Compile a validated source. Raises ConstraintError when the library refuses it."""
