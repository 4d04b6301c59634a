"""Where a JSON document may end: the tokens after which one whose root is an
object or an array can be complete.

A document whose root is an object or an array is complete only once the
root's closing bracket is written, and after it only whitespace may come. So
the last token of a complete document that is not whitespace alone holds a
``}`` or a ``]``: after any other token, asking the grammar whether the
document is complete (a native call a token) can be skipped. A scalar root
(a number, a string, ``true``) may be complete after any token.
"""

from __future__ import annotations

from collections.abc import Sequence

_BLANK = b" \t\n\r"   # JSON's whitespace


def end_tokens(token_bytes: Sequence[bytes]) -> tuple[frozenset[int], frozenset[int]]:
    """``(closers, blanks)`` by token id: the tokens holding a ``}`` or a ``]``,
    and those that are JSON whitespace alone (or no bytes: special tokens).
    Does not change state."""
    closers = frozenset(i for i, b in enumerate(token_bytes) if b"}" in b or b"]" in b)
    blanks = frozenset(i for i, b in enumerate(token_bytes) if not b.strip(_BLANK))
    return closers, blanks


def root_is_scalar(parts: Sequence[bytes]) -> bool | None:
    """Whether the document made of ``parts`` has a scalar root, read from its
    first byte that is not whitespace; None while it has none. Does not change
    state."""
    for part in parts:
        head = part.lstrip(_BLANK)[:1]
        if head:
            return head not in (b"{", b"[")
    return None
