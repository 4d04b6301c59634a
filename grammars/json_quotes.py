"""JSON strings as spans for the engine's premasking: which tokens may close
one, and whether a token does, by the parity of the output's unescaped double
quotes.

The engine masks a greedy row ahead of its next pick where its model keeps
breaking the grammar (see ``BaseConstraint.span_closing_tokens``). A model that
writes words well but ignores the grammar (one of random weights) breaks a JSON
grammar right after a string's closing quote, where the schema wants
punctuation; after an opening quote any word goes. A token closes a string when
the output's unescaped quotes, its own included, are even in number.
"""

from __future__ import annotations

from collections.abc import Sequence


def quote_counts(token_bytes: Sequence[bytes]) -> list[int]:
    """Each token's double quotes less its escaped ones (``\\"``), by token id.

    Does not change state."""
    return [b.count(b'"') - b.count(b'\\"') for b in token_bytes]


def quote_tokens(token_bytes: Sequence[bytes]) -> frozenset[int]:
    """The tokens that hold an unescaped double quote: those that may close a
    JSON string. Does not change state."""
    return frozenset(i for i, n in enumerate(quote_counts(token_bytes)) if n)


class QuoteParity:
    """Whether a token closes a JSON string, given the output before it: the
    parity of the output's unescaped quotes, counted on from where the last
    call stopped (a few list lookups a token, in C).

    Parameters
    ----------
    counts : list of int
        :func:`quote_counts` of the vocabulary (shared, not copied).
    """

    __slots__ = ("counts", "done", "parity")

    def __init__(self, counts: list[int]) -> None:
        self.counts = counts
        self.done = -1   # index into the token ids counted up to (-1: none yet)
        self.parity = 0  # of the quotes before ``done``

    def restart(self) -> None:
        """Count from the output's start at the next call (its tokens were replaced)."""
        self.done, self.parity = -1, 0

    def closes(self, token_ids: list[int], start: int, end: int, token: int) -> bool:
        """Whether ``token`` after the output ``token_ids[start:end]`` leaves an
        even number of unescaped quotes: out of a string (a key's or a value's
        end) rather than into one. Counts on from the last call's ``end``
        unless ``end`` is below it (tokens taken back)."""
        counts, done, parity = self.counts, self.done, self.parity
        if done < start or end < done:
            done, parity = start, 0
        if end > done:
            parity ^= sum(map(counts.__getitem__, token_ids[done:end])) & 1
            self.done, self.parity = end, parity
        return not (parity + counts[token]) & 1


class NoSpans:
    """What a matcher whose language has no JSON strings answers: no token closes one."""

    __slots__ = ()

    def restart(self) -> None:
        """Nothing to count again."""

    def closes(self, token_ids: list[int], start: int, end: int, token: int) -> bool:
        """Never."""
        return False


NO_SPANS = NoSpans()
