"""The tables grounding reads: per tokenizer (:class:`TokenIndex`) and per text
(:class:`GroundingText`).

A grounded string's content, as written (JSON-escaped), must be a substring of the
source text escaped as a JSON string body (``ensure_ascii=False``, UTF-8), starting
at a character boundary (never inside ``\\n``, ``\\u00e9`` or a multi-byte
character). A grounded number must be one of the text's numbers, written as
:func:`text_numbers` lists them.

The tokens a grounded string allows next are found by walking the escaped text from
each position where its content so far ends: every token spelled by the text from
there continues it, and every token spelled by the text up to a boundary and then a
``"`` closes it (what follows the quote is checked separately when it could matter).
"""

from __future__ import annotations

import bisect
import functools
import json
import re
from collections.abc import Iterable

import numpy as np

from formcast.grammars.vocab import Vocabulary

_NUMBER_CHARS = b"0123456789.eE+-"
_NUMBER_SET = frozenset(_NUMBER_CHARS)
_RUN = re.compile(r"(?<![0-9])(-?)([0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(\.[0-9]+)?")
_CACHE_LIMIT = 4096     # entries of a per-text cache before it is cleared


def _last_of(tokens: Iterable[bytes], chars: bytes) -> np.ndarray:
    """Per token, the index of its last byte in ``chars`` (-1: none)."""
    pattern = re.compile(b"[" + re.escape(chars) + b"]")
    out = []
    for t in tokens:
        last = -1
        for m in pattern.finditer(t):
            last = m.start()
        out.append(last)
    return np.asarray(out, dtype=np.int32)


def _first_unescaped_quote(token: bytes) -> int:
    """Index of the first ``"`` of ``token`` not escaped by a backslash inside it (-1)."""
    escaped = False
    for k, c in enumerate(token):
        if escaped:
            escaped = False
        elif c == 92:
            escaped = True
        elif c == 34:
            return k
    return -1


class TokenIndex:
    """What grounding needs of a vocabulary, built once per vocabulary (:func:`token_index`).

    Attributes
    ----------
    token_bytes : tuple of bytes
    by_bytes : dict
        Token bytes -> the ids spelling them.
    prefixes : set of bytes
        Every non-empty prefix of every token.
    sorted_bytes : list of bytes
        Token bytes in byte order (``sorted_ids`` gives their ids): the tokens with a
        given prefix are a slice.
    last_quote, last_number, last_comma : numpy.ndarray
        Per token (id order), index of its last ``"``, last digit or ``-``, last ``,``
        (-1: none).
    first_quote : numpy.ndarray
        Per token, index of its first ``"`` not escaped inside it (-1: none).
    """

    def __init__(self, vocab: Vocabulary) -> None:
        tokens = vocab.token_bytes
        self.token_bytes = tokens
        self.vocab_size = vocab.vocab_size
        self.words = vocab.bitmask_words
        self.eos = np.asarray(sorted(vocab.eos_token_ids), dtype=np.int64)
        by_bytes: dict[bytes, list[int]] = {}
        prefixes: set[bytes] = set()
        for tid, b in enumerate(tokens):
            if b:
                by_bytes.setdefault(b, []).append(tid)
                for k in range(1, len(b) + 1):
                    prefixes.add(b[:k])
        self.by_bytes = {b: np.asarray(ids, dtype=np.int64) for b, ids in by_bytes.items()}
        self.prefixes = prefixes
        order = sorted((b, tid) for tid, b in enumerate(tokens) if b)
        self.sorted_bytes = [b for b, _ in order]
        self.sorted_ids = np.asarray([tid for _, tid in order], dtype=np.int64)
        self.longest = max((len(b) for b in tokens), default=0)
        self.last_quote = _last_of(tokens, b'"')
        self.last_number = _last_of(tokens, b"0123456789-")
        self.last_comma = _last_of(tokens, b",")
        self.first_quote = np.asarray([_first_unescaped_quote(b) if b'"' in b else -1
                                       for b in tokens], dtype=np.int32)
        first = np.asarray([b[0] if b else -1 for b in tokens], dtype=np.int32)
        self.number_start = np.isin(first, list(_NUMBER_SET))
        self.non_number_start = (first >= 0) & ~self.number_start

    def prefix_range(self, prefix: bytes) -> tuple[int, int]:
        """Slice of ``sorted_bytes`` holding the tokens that start with ``prefix``."""
        lo = bisect.bisect_left(self.sorted_bytes, prefix)
        hi = bisect.bisect_left(self.sorted_bytes, prefix + b"\xff\xff\xff\xff", lo)
        return lo, hi

    def pack(self, allowed: np.ndarray) -> np.ndarray:
        """A bool array over token ids as an int32 bitmask row."""
        bits = np.zeros(self.words * 32, dtype=bool)
        bits[:len(allowed)] = allowed
        return np.packbits(bits, bitorder="little").view(np.int32)


@functools.lru_cache(maxsize=4)
def token_index(vocab: Vocabulary) -> TokenIndex:
    """The :class:`TokenIndex` of ``vocab`` (built once, kept for the last few)."""
    return TokenIndex(vocab)


def escape_text(text: str) -> tuple[bytes, bytes]:
    """``text`` as a JSON string body (UTF-8) and its boundaries (``1`` at each offset
    where a character or escape starts, and at the end)."""
    parts: list[bytes] = []
    marks: list[bytes] = []
    for ch in text:
        unit = json.dumps(ch, ensure_ascii=False)[1:-1].encode("utf-8", "surrogatepass")
        parts.append(unit)
        marks.append(b"\x01" + b"\x00" * (len(unit) - 1))
    marks.append(b"\x01")
    return b"".join(parts), b"".join(marks)


def text_numbers(text: str) -> frozenset[bytes]:
    """The numbers a grounded number may be, as JSON writes them, from ``text``.

    Each run of digits, with thousands separators (``1,299``) and a decimal part
    (``.50``), gives: the number without its separators (``1299.00``); without
    leading zeros (JSON allows none: ``08`` gives ``8``); if it has a decimal part,
    without its trailing zeros (``1299.0``, ``1299``), and its integer part alone;
    each digit group on its own (``1``, ``299``); the negative of each when a ``-``
    stands right before the digits and after no letter or digit (``-5`` in "-5 C",
    not in "35-year-old").
    """
    found: set[bytes] = set()

    def add(digits: str, negative: bool) -> None:
        whole, _, frac = digits.partition(".")
        whole = whole.lstrip("0") or "0"
        forms = [whole]
        if frac:
            forms.append(f"{whole}.{frac}")
            stripped = frac.rstrip("0")
            for k in range(len(stripped), len(frac)):
                forms.append(f"{whole}.{frac[:k]}" if k else whole)
        for form in forms:
            found.add(form.encode())
            if negative and form.strip("0.") != "":
                found.add(b"-" + form.encode())

    for m in _RUN.finditer(text):
        sign, whole, frac = m.group(1), m.group(2), m.group(3) or ""
        start = m.start()
        negative = bool(sign) and (start == 0 or not text[start - 1].isalnum())
        add(whole.replace(",", "") + frac, negative)
        for group in whole.split(","):
            add(group, negative and group == whole.split(",")[0])
        if frac:
            add(frac[1:], False)
    return frozenset(found)


class GroundingText:
    """The source text as grounding reads it, with per-text caches (shared by forks).

    Parameters
    ----------
    text : str
        The source text.
    index : TokenIndex
        The vocabulary's tables.
    strings, numbers, distinct : bool
        Whether strings, numbers are grounded, and array items kept distinct: which
        bytes of a token could matter to grounding (``"``, digits and ``-``, ``,``).
    """

    def __init__(self, text: str, index: TokenIndex, *, strings: bool, numbers: bool,
                 distinct: bool) -> None:
        self.text = text
        self.index = index
        last = np.full(len(index.token_bytes), -1, dtype=np.int32)
        for used, table in ((strings, index.last_quote), (numbers, index.last_number),
                            (distinct, index.last_comma)):
            if used:
                last = np.maximum(last, table)
        # per token, the index of its last byte that could matter (-1: none)
        self.last_sensitive = last
        self.sensitive_words = index.pack(last >= 0)
        # tokens that close a string and go on with a byte that could matter
        self.closing_words = index.pack((index.first_quote >= 0) & (last > index.first_quote))
        self.escaped, self.boundary = escape_text(text)
        self.numbers = text_numbers(text)
        self.number_prefixes = frozenset(n[:k] for n in self.numbers for k in range(1, len(n) + 1))
        self._ends: dict[bytes, tuple[int, ...]] = {}
        self._walks: dict[int, tuple[np.ndarray, tuple[tuple[int, int, int], ...]]] = {}
        self.string_masks: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
        self.number_masks: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}

    # -- membership -----------------------------------------------------------------

    def ends(self, content: bytes) -> tuple[int, ...]:
        """Offsets in the escaped text where ``content`` ends, having started at a
        boundary (all boundaries for empty content). Cached."""
        found = self._ends.get(content)
        if found is not None:
            return found
        E, boundary = self.escaped, self.boundary
        if not content:
            found = tuple(k for k in range(len(E) + 1) if boundary[k])
        else:
            out = []
            start = E.find(content)
            while start >= 0:
                if boundary[start]:
                    out.append(start + len(content))
                start = E.find(content, start + 1)
            found = tuple(out)
        if len(self._ends) >= _CACHE_LIMIT:
            self._ends.clear()
        self._ends[content] = found
        return found

    def has_string_prefix(self, content: bytes) -> bool:
        """Whether ``content`` (escaped) occurs in the text from a boundary."""
        return bool(self.ends(content))

    def has_string(self, content: bytes) -> bool:
        """Whether ``content`` is a whole value: it occurs from a boundary to a boundary."""
        boundary = self.boundary
        return any(boundary[e] for e in self.ends(content))

    def has_number_prefix(self, written: bytes) -> bool:
        return written in self.number_prefixes

    def has_number(self, written: bytes) -> bool:
        return written in self.numbers

    # -- masks ------------------------------------------------------------------------

    def _walk(self, p: int) -> tuple[np.ndarray, tuple[tuple[int, int, int], ...]]:
        """From escaped offset ``p``: the ids of tokens the text spells from there, and
        (lo, hi, quote offset) slices of the sorted tokens that the text spells up to
        a boundary and then a closing quote."""
        found = self._walks.get(p)
        if found is not None:
            return found
        idx, E, boundary = self.index, self.escaped, self.boundary
        prefixes, by_bytes = idx.prefixes, idx.by_bytes
        ids: list[np.ndarray] = []
        closes: list[tuple[int, int, int]] = []
        end = min(len(E), p + idx.longest)
        k = p
        while True:
            if boundary[k]:
                s = E[p:k] + b'"'
                if s in prefixes:
                    lo, hi = idx.prefix_range(s)
                    closes.append((lo, hi, k - p))
            if k >= end:
                break
            k += 1
            s = E[p:k]
            if s not in prefixes:
                break
            got = by_bytes.get(s)
            if got is not None:
                ids.append(got)
        found = (np.concatenate(ids) if ids else np.empty(0, dtype=np.int64), tuple(closes))
        if len(self._walks) >= _CACHE_LIMIT:
            self._walks.clear()
        self._walks[p] = found
        return found

    def string_mask(self, content: bytes) -> tuple[np.ndarray, np.ndarray]:
        """For a grounded string whose content so far is ``content``: the bitmask row
        of tokens allowed whatever follows their closing quote, and the ids of
        closing tokens whose rest holds a byte that could matter, to check one by one."""
        found = self.string_masks.get(content)
        if found is not None:
            return found
        idx, last_sensitive = self.index, self.last_sensitive
        allowed = np.zeros(len(idx.token_bytes), dtype=bool)
        check: list[np.ndarray] = []
        seen_closes: set[tuple[int, int, int]] = set()
        for p in self.ends(content):
            ids, closes = self._walk(p)
            allowed[ids] = True
            for close in closes:
                if close in seen_closes:
                    continue
                seen_closes.add(close)
                lo, hi, q = close
                tids = idx.sorted_ids[lo:hi]
                late = last_sensitive[tids] > q
                allowed[tids[~late]] = True
                check.append(tids[late])
        found = (idx.pack(allowed),
                 np.unique(np.concatenate(check)) if check else np.empty(0, dtype=np.int64))
        if len(self.string_masks) >= _CACHE_LIMIT:
            self.string_masks.clear()
        self.string_masks[content] = found
        return found

    def number_mask(self, written: bytes) -> tuple[np.ndarray, np.ndarray]:
        """As :meth:`string_mask`, for a grounded number written so far as ``written``:
        the tokens that keep it a prefix of one of the text's numbers, and those that
        end it where it is whole (to check one by one when they go on)."""
        found = self.number_masks.get(written)
        if found is not None:
            return found
        idx, last_sensitive = self.index, self.last_sensitive
        allowed = np.zeros(len(idx.token_bytes), dtype=bool)
        check: list[np.ndarray] = []
        for number in self.numbers:
            if not number.startswith(written):
                continue
            rest = number[len(written):]
            for k in range(1, len(rest) + 1):
                got = idx.by_bytes.get(rest[:k])
                if got is not None:
                    allowed[got] = True
            if rest:
                lo, hi = idx.prefix_range(rest)
                tids = idx.sorted_ids[lo:hi]
                longer = np.asarray([len(idx.token_bytes[t]) > len(rest) and
                                     idx.token_bytes[t][len(rest)] not in _NUMBER_SET
                                     for t in tids], dtype=bool)
                check.append(tids[longer] if len(tids) else tids)
            else:
                ending = idx.non_number_start.copy()
                late = last_sensitive >= 0
                allowed |= ending & ~late
                check.append(np.flatnonzero(ending & late))
                allowed[idx.eos] = True
        found = (idx.pack(allowed),
                 np.unique(np.concatenate(check)) if check else np.empty(0, dtype=np.int64))
        if len(self.number_masks) >= _CACHE_LIMIT:
            self.number_masks.clear()
        self.number_masks[written] = found
        return found
