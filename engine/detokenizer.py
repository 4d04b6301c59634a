"""Incremental detokenization: a stream of token ids into text deltas that never
end inside a UTF-8 character."""

from __future__ import annotations

import codecs
import operator
from typing import TYPE_CHECKING

from formcast.engine.errors import RequestError

if TYPE_CHECKING:
    from formcast.engine.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Each :meth:`feed` returns only whole characters: bytes of a UTF-8 character split
    across tokens are held back until it completes, so no delta ends in a spurious
    U+FFFD. The deltas plus :meth:`flush` concatenate to ``tokenizer.decode(ids)``.
    One instance per sequence; it is stateful.

    Parameters
    ----------
    tokenizer : Tokenizer
    skip_special_tokens : bool
        Emit nothing for special tokens (as ``decode(..., skip_special_tokens=True)``).
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False) -> None:
        # (skipping special tokens: a table where they stand for no bytes)
        self._bytes = tokenizer._text_bytes if skip_special_tokens else tokenizer._token_bytes
        self._strip_space = tokenizer.strips_leading_space
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._started = False

    def feed(self, token_id: int) -> str:
        """Add one token; return the text it completes (maybe ``""``). Changes state.

        Raises
        ------
        RequestError
            ``token_id`` is outside the vocabulary.
        """
        if not 0 <= token_id < len(self._bytes):
            raise RequestError(
                f"token id {token_id} is outside the vocabulary [0, {len(self._bytes)})")
        return self._emit(self._utf8.decode(self._bytes[token_id]))

    def feed_many(self, token_ids: list[int]) -> str:
        """:meth:`feed` of each of ``token_ids`` in turn, joined: the bytes are
        decoded in one call (a request's deferred tokens, read at once).

        Raises
        ------
        RequestError
            An id is outside the vocabulary (nothing is fed then).
        """
        if not token_ids:
            return ""
        table = self._bytes
        # (one itemgetter over the ids: the fastest gather of many table entries; an
        # id past the table raises, a negative one would count from its end)
        try:
            got = operator.itemgetter(*token_ids)(table) if min(token_ids) >= 0 else None
        except IndexError:
            got = None
        if got is None:
            bad = next(t for t in token_ids if not 0 <= t < len(table))
            raise RequestError(f"token id {bad} is outside the vocabulary [0, {len(table)})")
        return self._emit(self._utf8.decode(b"".join(got) if len(token_ids) > 1 else got))

    def flush(self) -> str:
        """Return what is held back (an unfinished character becomes U+FFFD). Changes state."""
        return self._emit(self._utf8.decode(b"", final=True))

    def _emit(self, text: str) -> str:
        # Sentencepiece decoders drop the space the encoder put before the first word.
        if text and not self._started:
            self._started = True
            if self._strip_space and text.startswith(" "):
                text = text[1:]
        return text
