"""The tokenizer as the grammar layer sees it: the bytes of every token id.

Built from formcast's own :class:`~formcast.engine.Tokenizer` (no transformers at run
time) or from a list of tokens (tests use tiny synthetic vocabularies). Special and
stop tokens are given no bytes, so no backend can ever place one inside a structure;
stop tokens are allowed only where the structure is complete. Ids from the
tokenizer's size up to the model's ``vocab_size`` (padding) are never allowed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

from formcast.engine.constraint import bitmask_words
from formcast.grammars.json_ends import end_tokens
from formcast.grammars.json_quotes import quote_counts


class TokenizerLike(Protocol):
    """What :meth:`Vocabulary.from_tokenizer` reads (formcast's Tokenizer has it)."""

    vocab_size: int
    eos_token_ids: frozenset[int]
    special_token_ids: frozenset[int]

    def token_bytes(self) -> list[bytes]: ...

    def fingerprint(self) -> str: ...


@dataclass(frozen=True, eq=False)
class Vocabulary:
    """Token bytes, stop ids and mask width for compiling grammars.

    Parameters
    ----------
    token_bytes : tuple of bytes
        Index ``i`` holds the bytes token ``i`` stands for; ``b""`` for special and stop
        tokens (they can never be part of the text).
    eos_token_ids : frozenset of int
        Tokens that end generation; allowed only where the constraint is complete.
    vocab_size : int
        Width of the model's logits (>= ``len(token_bytes)``); ids past the tokenizer
        are padding and never allowed.
    fingerprint : str
        Identifies the token-id mapping; part of every compile-cache key.
    """

    token_bytes: tuple[bytes, ...]
    eos_token_ids: frozenset[int]
    vocab_size: int
    fingerprint: str
    special_token_ids: frozenset[int] = field(default=frozenset())

    def __post_init__(self) -> None:
        if not self.eos_token_ids:
            raise ValueError("a vocabulary needs at least one eos token id")
        if self.vocab_size < len(self.token_bytes):
            raise ValueError(f"vocab_size {self.vocab_size} is smaller than the tokenizer's "
                             f"{len(self.token_bytes)} tokens")
        bad = [i for i in self.eos_token_ids if not 0 <= i < len(self.token_bytes)]
        if bad:
            raise ValueError(f"eos token ids {bad} are outside the vocabulary")

    @classmethod
    def from_tokenizer(cls, tokenizer: TokenizerLike, *, vocab_size: int | None = None
                       ) -> Vocabulary:
        """Read a tokenizer's token bytes. Does not change the tokenizer.

        Parameters
        ----------
        tokenizer : Tokenizer
            formcast's tokenizer (or anything with the same token-bytes API).
        vocab_size : int or None
            The model's logits width; defaults to the tokenizer's size.
        """
        blanked = set(tokenizer.special_token_ids) | set(tokenizer.eos_token_ids)
        tokens = tuple(b"" if i in blanked else b for i, b in enumerate(tokenizer.token_bytes()))
        width = tokenizer.vocab_size if vocab_size is None else vocab_size
        return cls(token_bytes=tokens, eos_token_ids=frozenset(tokenizer.eos_token_ids),
                   vocab_size=width, fingerprint=f"{tokenizer.fingerprint()}:{width}",
                   special_token_ids=frozenset(blanked))

    @classmethod
    def from_tokens(cls, tokens: Sequence[bytes | str], *, eos_token_ids: Iterable[int],
                    special_token_ids: Iterable[int] = (), vocab_size: int | None = None
                    ) -> Vocabulary:
        """Build a vocabulary from explicit tokens (synthetic vocabularies in tests).

        Parameters
        ----------
        tokens : sequence of bytes or str
            Token ``i``'s text (str is UTF-8 encoded).
        eos_token_ids, special_token_ids : iterable of int
            Stop tokens and other control tokens (both get no bytes).
        vocab_size : int or None
            Logits width, default ``len(tokens)``.
        """
        eos = frozenset(eos_token_ids)
        blanked = frozenset(special_token_ids) | eos
        raw = [t.encode("utf-8") if isinstance(t, str) else bytes(t) for t in tokens]
        token_bytes = tuple(b"" if i in blanked else b for i, b in enumerate(raw))
        width = len(raw) if vocab_size is None else vocab_size
        digest = hashlib.sha256(repr((raw, sorted(eos), sorted(blanked))).encode()).hexdigest()
        return cls(token_bytes=token_bytes, eos_token_ids=eos, vocab_size=width,
                   fingerprint=f"tokens:{digest}:{width}", special_token_ids=blanked)

    @property
    def tokenizer_size(self) -> int:
        """Number of ids the tokenizer defines (the rest of ``vocab_size`` is padding)."""
        return len(self.token_bytes)

    @property
    def bitmask_words(self) -> int:
        """int32 words of one bitmask row."""
        return bitmask_words(self.vocab_size)

    @cached_property
    def quote_counts(self) -> list[int]:
        """Each token's unescaped double quotes, by id (see
        :func:`~formcast.grammars.json_quotes.quote_counts`); found once."""
        return quote_counts(self.token_bytes)

    @cached_property
    def json_end_tokens(self) -> tuple[frozenset[int], frozenset[int]]:
        """``(closers, blanks)``: the tokens after which a JSON document whose
        root is a container may be complete, and whitespace tokens (see
        :func:`~formcast.grammars.json_ends.end_tokens`); found once."""
        return end_tokens(self.token_bytes)

    @cached_property
    def _by_bytes(self) -> dict[bytes, int]:
        table: dict[bytes, int] = {}
        for i, b in enumerate(self.token_bytes):
            if b and b not in table:
                table[b] = i
        return table

    @cached_property
    def _longest(self) -> int:
        return max((len(b) for b in self.token_bytes), default=0)

    def segment(self, data: bytes) -> list[int] | None:
        """Split ``data`` into the fewest token ids whose bytes concatenate to it.

        Does not change state. Returns None when no split exists.
        """
        n = len(data)
        best: list[tuple[int, int] | None] = [None] * (n + 1)   # (count, token) ending here
        best[0] = (0, -1)
        table, longest = self._by_bytes, self._longest
        for end in range(1, n + 1):
            for start in range(max(0, end - longest), end):
                prev = best[start]
                if prev is None:
                    continue
                tid = table.get(data[start:end])
                if tid is not None and (best[end] is None or prev[0] + 1 < best[end][0]):
                    best[end] = (prev[0] + 1, tid)
        if best[n] is None:
            return None
        ids: list[int] = []
        pos = n
        while pos > 0:
            tid = best[pos][1]
            ids.append(tid)
            pos -= len(self.token_bytes[tid])
        return ids[::-1]
