"""The per-request matcher: the engine's ``LogitsConstraint`` plus text and fork helpers.

A :class:`Matcher` is cheap to create from a compiled grammar and holds one
request's parse state. Backends subclass it directly, so the engine's per-token
calls reach the backend with no extra layer; :class:`EndCheckedMatcher` wraps one
when part of a JSON Schema is checked on the finished document instead of by the
mask.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence

import torch

from formcast.engine.constraint import BaseConstraint, accept_forced_tokens, bitmask_words
from formcast.grammars.constraints import JsonSchema
from formcast.grammars.end_violation import EndViolation
from formcast.grammars.json_ends import root_is_scalar
from formcast.grammars.json_quotes import NO_SPANS, NoSpans, QuoteParity, quote_tokens


class Matcher(BaseConstraint):
    """Grammar state of one request; implements :class:`formcast.engine.LogitsConstraint`.

    ``rollback`` counts steps: one per accepted token, one per :meth:`accept_text`.
    """

    def __reduce__(self):
        # _recipe: (constraint, backend, vocabulary) of the grammar the matcher was
        # made from, set by CompiledGrammar.matcher() (a slot of every subclass)
        recipe = getattr(self, "_recipe", None)
        if recipe is None:
            raise TypeError(f"{type(self).__name__} cannot be sent to another process: only "
                            "matchers made by CompiledGrammar.matcher() can")
        if not self._is_fresh():
            raise TypeError("only a fresh matcher (no token accepted yet) can be sent to "
                            "another process")
        return (_matcher_from_recipe, recipe)

    def _is_fresh(self) -> bool:
        """Whether no token was accepted yet (False when unsure)."""
        return False

    # _spans: what closes_span counted (made on first use; a subclass's rollback
    # calls _restart_spans)
    __slots__ = ("_spans",)

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]``. Does not change state.

        Parameters
        ----------
        bitmask : torch.Tensor
            int32 ``[rows, ceil(vocab_size/32)]`` on the CPU, contiguous; bit ``t % 32``
            of word ``t // 32`` set means token ``t`` is allowed.
        row : int
            The row to overwrite.
        """

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance by one token. Changes state only when it returns True.

        Returns
        -------
        bool
            False if the token is not allowed here (the state is left unchanged).
        """

    @abstractmethod
    def accept_text(self, text: str) -> bool:
        """Advance by a whole string as one step. Changes state only when it returns True."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` steps. Changes state.

        Raises
        ------
        ValueError
            If more steps are asked for than were taken.
        """

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once a stop token was accepted. Does not change state."""

    @abstractmethod
    def is_completed(self) -> bool:
        """True if the text so far is a complete match (a stop token is allowed now)."""

    @abstractmethod
    def forced_tokens(self) -> list[int]:
        """Tokens the grammar fixes from here (jump-forward). Does not change state.

        The caller may accept and prefill them without sampling. May be empty.
        """

    def take_forced_tokens(self, limit: int) -> list[int]:
        """Take the tokens the grammar fixes from here, at most ``limit`` of
        them, and return those taken (the engine's jump-forward at a request's
        start: it appends them to the prompt's prefill)."""
        return accept_forced_tokens(self, limit)

    @abstractmethod
    def fork(self) -> Matcher:
        """An independent copy of this matcher with the same state."""

    @classmethod
    def span_closing_tokens(cls, token_bytes: Sequence[bytes]) -> frozenset[int]:
        """The tokens holding an unescaped double quote: those that may close a
        JSON string (the engine's premasking watches the picks after them). Does
        not change state."""
        return quote_tokens(token_bytes)

    def closes_span(self, token_ids: list[int], start: int, end: int, token: int) -> bool:
        """Whether ``token`` after the output ``token_ids[start:end]`` closes a
        JSON string (:class:`~formcast.grammars.json_quotes.QuoteParity`, counted
        on from the last call); never for a matcher of another language. Does
        not change the grammar state."""
        try:
            spans = self._spans
        except AttributeError:
            spans = self._spans = self._span_counter()
        return spans.closes(token_ids, start, end, token)

    def _span_counter(self) -> QuoteParity | NoSpans:
        """What :meth:`closes_span` counts with: quotes for a JSON Schema's
        matcher (made by ``CompiledGrammar.matcher``), nothing otherwise."""
        recipe = getattr(self, "_recipe", None)
        if recipe is None or not isinstance(recipe[0], JsonSchema):
            return NO_SPANS
        return QuoteParity(recipe[2].quote_counts)

    def _restart_spans(self) -> None:
        """Count the output's quotes from its start again (a rollback replaced tokens)."""
        spans = getattr(self, "_spans", None)
        if spans is not None:
            spans.restart()

    def rollback_hint(self) -> int:
        """Steps to roll back to leave a dead end the end check caused (0: none).

        Only :class:`EndCheckedMatcher` ever returns more than 0. Does not change state.
        """
        return 0

    def valid_prefix(self, draft: Sequence[int]) -> int:
        """How many leading tokens of ``draft`` the grammar allows. State is unchanged.

        Parameters
        ----------
        draft : sequence of int
            Proposed tokens (e.g. a speculative draft).

        Returns
        -------
        int
            The length of the longest allowed prefix; nothing after a stop token counts.
        """
        n = 0
        for token in draft:
            if self.is_terminated() or not self.accept(token):
                break
            n += 1
        if n:
            self.rollback(n)
        return n


class EndCheckedMatcher(Matcher):
    """Refuses stop tokens until the finished text passes ``check``.

    Wraps a backend matcher for constraints the mask enforces only in part (JSON
    Schema keywords the backend does not compile). When the structure is complete
    but the check fails, the stop tokens are taken out of the mask, so generation
    must go on or dead-ends; :attr:`last_violation` then says why.

    With ``ends`` (:func:`~formcast.grammars.json_ends.end_tokens` of the
    vocabulary) it asks the inner matcher whether the document is complete only
    after a token that may complete it (see :mod:`~formcast.grammars.json_ends`).
    """

    __slots__ = ("_inner", "_check", "_token_bytes", "_eos", "_parts", "_verdict",
                 "_inner_fill", "_inner_accept", "_inner_completed", "_recipe", "_ends",
                 "_watch", "_may_end", "_rooted")

    def __init__(self, inner: Matcher, check: Callable[[bytes], EndViolation | None],
                 token_bytes: Sequence[bytes], eos_token_ids: frozenset[int],
                 parts: list[bytes] | None = None,
                 ends: tuple[frozenset[int], frozenset[int]] | None = None) -> None:
        self._inner = inner
        # bound once: the per-token path
        self._inner_fill, self._inner_accept = inner.fill_bitmask, inner.accept
        self._inner_completed = inner.is_completed
        self._check = check
        self._token_bytes = token_bytes
        self._eos = eos_token_ids
        self._parts: list[bytes] = [] if parts is None else parts   # one entry per step
        self._verdict: tuple[EndViolation | None] | None = None   # None: not checked since a change
        self._ends = ends
        self._restart_ends()

    def _restart_ends(self) -> None:
        """Forget where the document may end: it may be complete now (a state
        not reached token by token)."""
        self._watch = self._ends   # (closers, blanks); None: every step may complete it
        self._may_end = True       # False only when the inner matcher cannot be complete
        self._rooted = False       # whether the root is known to be an object or an array

    def _see_root(self) -> None:
        """The root of the text so far, once a token that is not whitespace took
        it past a closer: a scalar root may be complete after any step."""
        scalar = root_is_scalar(self._parts)
        if scalar:
            self._watch = None
            self._may_end = True
        self._rooted = scalar is not None

    @property
    def inner(self) -> Matcher:
        """The backend matcher it wraps."""
        return self._inner

    def _violation(self) -> EndViolation | None:
        verdict = self._verdict
        if verdict is None:
            verdict = self._verdict = (self._check(b"".join(self._parts)),)
        return verdict[0]

    @property
    def last_violation(self) -> str | None:
        """Why the finished document fails its end check; None while it is
        incomplete or passes. (Computed from the current state, cached.)"""
        if not self._may_end or not self._inner_completed():
            return None
        found = self._violation()
        return None if found is None else found.message

    def rollback_hint(self) -> int:
        """Steps to roll back so that the value failing the end check can be redone.

        Does not change state. 0 when the text so far is incomplete or passes; else the
        number of steps back to the step holding the first byte that must change (the
        offending value, or the closing bracket of a container missing something).
        An engine that meets a dead end here can roll back that many tokens (matcher
        and KV cache) and sample again instead of failing the request.
        """
        if not self._may_end or not self._inner_completed():
            return 0
        violation = self._violation()
        if violation is None:
            return 0
        offset = 0
        for k, part in enumerate(self._parts):
            if offset + len(part) > violation.start:
                return len(self._parts) - k
            offset += len(part)
        return 0

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._inner_fill(bitmask, row)
        if self._may_end and self._inner_completed() and self._violation() is not None:
            for eos in self._eos:
                word = eos >> 5
                value = int(bitmask[row, word]) & ~(1 << (eos & 31)) & 0xFFFFFFFF
                bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value

    def _is_fresh(self) -> bool:
        return not self._parts and self._inner._is_fresh()

    @classmethod
    def prepare(cls, constraints: list) -> None:
        """The inner matchers readied by their own kind (the engine's hook, see
        :meth:`formcast.engine.constraint.BaseConstraint.prepare`)."""
        by_kind: dict[type, list[Matcher]] = {}
        for c in constraints:
            by_kind.setdefault(type(c._inner), []).append(c._inner)
        for kind, inner in by_kind.items():
            kind.prepare(inner)

    def accept(self, token_id: int) -> bool:
        if token_id in self._eos:
            if not self._may_end or not self._inner_completed() \
                    or self._violation() is not None or not self._inner_accept(token_id):
                return False
            self._parts.append(b"")
        elif self._inner_accept(token_id):
            self._parts.append(self._token_bytes[token_id])
            watch = self._watch
            if watch is not None:
                if token_id in watch[0]:
                    self._may_end = True
                elif token_id not in watch[1]:
                    self._may_end = False
                    if not self._rooted:
                        self._see_root()
        else:
            return False
        self._verdict = None
        return True

    def accept_text(self, text: str) -> bool:
        if not self._inner.accept_text(text):
            return False
        self._parts.append(text.encode("utf-8"))
        self._verdict = None
        self._restart_ends()
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > len(self._parts):
            raise ValueError(f"cannot roll back {num_tokens} steps; only {len(self._parts)} taken")
        self._inner.rollback(num_tokens)
        if num_tokens:
            del self._parts[-num_tokens:]
            self._verdict = None
            self._restart_ends()
            self._restart_spans()

    def is_terminated(self) -> bool:
        return self._inner.is_terminated()

    def is_completed(self) -> bool:
        return self._may_end and self._inner.is_completed() and self._violation() is None

    def forced_tokens(self) -> list[int]:
        return [t for t in self._inner.forced_tokens() if t not in self._eos]

    def take_forced_tokens(self, limit: int) -> list[int]:
        """The inner matcher's (its own shortcuts kept), the text kept here."""
        if self._parts:  # (forced tokens hold no end token: only a fresh one's are taken)
            return super().take_forced_tokens(limit)
        taken = self._inner.take_forced_tokens(limit)
        if taken:
            self._parts.extend(self._token_bytes[t] for t in taken)
            self._verdict = None
            self._restart_ends()
        return taken

    def forces_text(self) -> bool:
        """The inner matcher's."""
        return self._inner.forces_text()

    def narrow_choice(self) -> bool:
        """The inner matcher's."""
        return self._inner.narrow_choice()

    def fork(self) -> EndCheckedMatcher:
        copy = EndCheckedMatcher(self._inner.fork(), self._check, self._token_bytes, self._eos,
                                 list(self._parts), self._ends)
        copy._watch, copy._may_end, copy._rooted = self._watch, self._may_end, self._rooted
        return copy


def check_bitmask(bitmask: torch.Tensor, row: int, vocab_size: int) -> None:
    """Raise ValueError unless ``bitmask`` is a CPU int32 contiguous mask for ``vocab_size``."""
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
        raise ValueError("bitmask must be a contiguous int32 CPU tensor, got "
                         f"{bitmask.dtype} on {bitmask.device}")
    if bitmask.dim() != 2 or bitmask.shape[1] != bitmask_words(vocab_size):
        raise ValueError(f"bitmask must have {bitmask_words(vocab_size)} words a row for "
                         f"vocab_size {vocab_size}, got shape {tuple(bitmask.shape)}")
    if not 0 <= row < bitmask.shape[0]:
        raise ValueError(f"row {row} is outside a bitmask of {bitmask.shape[0]} rows")


def _matcher_from_recipe(constraint, backend: str, vocab) -> Matcher:
    """A fresh matcher for ``constraint``, compiled (or found in this process's
    cache) for ``vocab``: how a matcher is rebuilt in another process."""
    from formcast.grammars.compiler import default_compiler

    compiled = default_compiler().compile(constraint, vocab, backend=backend,
                                          vocab_size=vocab.vocab_size)
    return compiled.matcher()
