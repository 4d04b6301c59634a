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
import re
import threading
from collections.abc import Sequence

import numpy as np

from formcast.grammars.grounding_source import START, STOP, source_tables
from formcast.grammars.vocab import Vocabulary

_NUMBER_CHARS = b"0123456789.eE+-"
_NUMBER_SET = frozenset(_NUMBER_CHARS)
_RUN = re.compile(r"(?<![0-9])(-?)([0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(\.[0-9]+)?")
_DECIMAL_COMMA = re.compile(r"(?<![0-9,.])([0-9]+),([0-9]{1,2})(?![0-9])")
_CACHE_LIMIT = 4096     # entries of a per-text cache before it is cleared
_TEXTS_KEPT = 16        # texts whose tables a TokenIndex keeps


def _last_of(tokens: Sequence[bytes], chars: bytes, *, final: bool = True) -> np.ndarray:
    """Per token, the index of its last byte in ``chars`` (-1: none); with ``final``
    False, a token's last byte does not count."""
    lengths = np.fromiter((len(t) for t in tokens), dtype=np.int64, count=len(tokens))
    flat = np.frombuffer(b"".join(tokens), dtype=np.uint8)
    owner = np.repeat(np.arange(len(tokens)), lengths)
    at = np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    hit = np.isin(flat, np.frombuffer(chars, dtype=np.uint8))
    if not final:
        hit &= at < lengths[owner] - 1
    last = np.full(len(tokens), -1, dtype=np.int64)
    np.maximum.at(last, owner[hit], at[hit])
    return last.astype(np.int32)


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
    nodes : dict
        Every non-empty prefix ``s`` of a token -> 0, or the number of its entry in
        ``node_info``: (the ids spelling ``s``, the slice of ``sorted_bytes`` starting
        with ``s + b'"'`` or None).
    sorted_bytes : list of bytes
        Token bytes in byte order (``sorted_ids`` gives their ids): the tokens with a
        given prefix are a slice.
    last_quote, last_number, last_comma : numpy.ndarray
        Per token (id order), index of its last ``"`` other than its last byte, of its
        last digit or ``-``, of its last ``,`` (-1: none).
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
        for tid, b in enumerate(tokens):
            if b:
                by_bytes.setdefault(b, []).append(tid)
        self.by_bytes = {b: tuple(ids) for b, ids in by_bytes.items()}
        order = sorted((b, tid) for tid, b in enumerate(tokens) if b)
        self.sorted_bytes = [b for b, _ in order]
        self.sorted_ids = np.asarray([tid for _, tid in order], dtype=np.int64)
        # every prefix of a token -> 0, or the number of its entry in node_info:
        # (ids spelling it, slice of the tokens spelling it + '"' or None)
        nodes = dict.fromkeys({b[:k] for b in by_bytes for k in range(1, len(b) + 1)}, 0)
        info: list[tuple[tuple[int, ...], tuple[int, int] | None]] = [((), None)]
        closings = {b[:k] for b in by_bytes if b'"' in b for k in range(1, len(b))
                    if b[k] == 34}
        for s in by_bytes.keys() | closings:
            nodes[s] = len(info)
            info.append((self.by_bytes.get(s, ()),
                         self.prefix_range(s + b'"') if s in closings else None))
        self.nodes = nodes
        self.node_info = info
        self.root_close = self.prefix_range(b'"')
        self.longest = max((len(b) for b in tokens), default=0)
        # (a quote that ends a token opens an empty string, or closes a string the
        # token's earlier bytes hold: it matters through those only)
        self.last_quote = _last_of(tokens, b'"', final=False)
        self.last_number = _last_of(tokens, b"0123456789-")
        self.last_comma = _last_of(tokens, b",")
        self.first_quote = np.asarray([_first_unescaped_quote(b) if b'"' in b else -1
                                       for b in tokens], dtype=np.int32)
        first = np.asarray([b[0] if b else -1 for b in tokens], dtype=np.int32)
        self.number_start = np.isin(first, list(_NUMBER_SET))
        self.non_number_start = (first >= 0) & ~self.number_start
        # tokens that start a JSON number (a digit or "-")
        self.number_opening_words = self.pack(np.isin(first, list(b"0123456789-")))
        # tokens that start by closing a string (what a string that loops may take)
        self.quote_opening_words = self.pack(self.first_quote == 0)
        self._sensitivities: dict[tuple[bool, bool, bool], Sensitivity] = {}
        self._texts: dict[tuple[str, tuple[bool, bool, bool]], GroundingText] = {}
        self._lock = threading.Lock()     # (requests are made on many threads)

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

    def words_of(self, ids: np.ndarray) -> np.ndarray:
        """Token ids as an int32 bitmask row."""
        words = np.zeros(self.words, dtype=np.uint32)
        if len(ids):
            np.bitwise_or.at(words, ids >> 5, np.left_shift(1, ids & 31).astype(np.uint32))
        return words.view(np.int32)

    def sensitivity(self, strings: bool, numbers: bool, distinct: bool) -> Sensitivity:
        """Which tokens could matter to grounding of that kind (built once each)."""
        key = (strings, numbers, distinct)
        with self._lock:
            found = self._sensitivities.get(key)
            if found is None:
                found = self._sensitivities[key] = Sensitivity(self, *key)
        return found

    def grounding_text(self, text: str, *, strings: bool, numbers: bool, distinct: bool,
                       words: bool = False, capitalise: bool = False,
                       breaks: frozenset[int] = frozenset()) -> GroundingText:
        """The :class:`GroundingText` of ``text`` (the last few are kept: a request
        repeated, or several schemas over one text, share its tables)."""
        key = (text, (strings, numbers, distinct, words, capitalise, breaks))
        with self._lock:
            found = self._texts.get(key)
        if found is None:
            found = GroundingText(text, self, strings=strings, numbers=numbers,
                                  distinct=distinct, words=words, capitalise=capitalise,
                                  breaks=breaks)
            with self._lock:
                if len(self._texts) >= _TEXTS_KEPT:
                    self._texts.pop(next(iter(self._texts)))
                found = self._texts.setdefault(key, found)
        return found


def _located(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token ids with the word and bit shift of each in a bitmask row."""
    return ids, ids >> 5, (ids & 31).astype(np.uint32)


class Sensitivity:
    """The tokens that could matter to grounding, for what is grounded.

    A token matters only through its bytes that could open a grounded value (``"``
    when strings are grounded, digits and ``-`` when numbers are) or end a repeated
    array item (``,`` with distinct items).

    Attributes
    ----------
    last : numpy.ndarray
        Per token, the index of its last byte that could matter (-1: none).
    any : tuple of numpy.ndarray
        Tokens with such a byte: (ids, their bitmask words, their bits' shifts).
    closing : tuple of numpy.ndarray
        As ``any``, for the tokens that close a string (an unescaped ``"``) and hold
        such a byte after it.
    ending_words, ending_check_words : numpy.ndarray
        Bitmask rows of the tokens that can end a whole grounded number (starting
        with a byte no number holds): without a byte that matters, and with one.
    """

    def __init__(self, index: TokenIndex, strings: bool, numbers: bool, distinct: bool) -> None:
        self.key = (strings, numbers, distinct)
        last = np.full(len(index.token_bytes), -1, dtype=np.int32)
        for used, table in ((strings, index.last_quote), (numbers, index.last_number),
                            (distinct, index.last_comma)):
            if used:
                last = np.maximum(last, table)
        self.last = last
        self.any = _located(np.flatnonzero(last >= 0))
        self.closing = _located(np.flatnonzero((index.first_quote >= 0) &
                                               (last > index.first_quote)))
        ending = index.non_number_start.copy()
        ending[index.eos] = True
        self.ending_words = index.pack(ending & (last < 0))
        self.ending_check_words = index.pack(ending & (last >= 0))


@functools.lru_cache(maxsize=4)
def token_index(vocab: Vocabulary) -> TokenIndex:
    """The :class:`TokenIndex` of ``vocab`` (built once, kept for the last few)."""
    return TokenIndex(vocab)


def _live(escaped: bytes, boundary: bytes) -> bytes:
    """Per offset of ``escaped``, whether a value whose content ends there can still
    end: a stop lies at or after it before the next NUL (no token leads a grounded
    string where it can only run into a break)."""
    live = bytearray(len(escaped) + 1)
    live[-1] = bool(boundary[-1] & STOP)
    for k in range(len(escaped) - 1, -1, -1):
        live[k] = bool(boundary[k] & STOP) or (escaped[k] != 0 and live[k + 1])
    return bytes(live)


def text_numbers(text: str) -> frozenset[bytes]:
    """The numbers a grounded number may be, as JSON writes them, from ``text``.

    Each run of digits, with thousands separators (``1,299``) and a decimal part
    (``.50``), gives: the number without its separators (``1299.00``); without
    leading zeros (JSON allows none: ``08`` gives ``8``); if it has a decimal part,
    without its trailing zeros (``1299.0``, ``1299``; but ``89.99`` never gives
    ``89``, a number the text does not write);
    the negative of each when a ``-`` stands right before the digits and after no
    letter or digit (``-5`` in "-5 C", not in "35-year-old"). A decimal comma
    (``4,95``: one or two digits after it) also gives the number with a point
    (``4.95``). Digits right after a capital letter name a model, not a quantity
    ("Galaxy S24", "V15"): they give nothing.
    """
    found: set[bytes] = set()

    def add(digits: str, negative: bool) -> None:
        whole, _, frac = digits.partition(".")
        whole = whole.lstrip("0") or "0"
        forms = [] if frac else [whole]
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
        if not sign and start and text[start - 1].isupper():
            continue
        negative = bool(sign) and (start == 0 or not text[start - 1].isalnum())
        add(whole.replace(",", "") + frac, negative)
    for m in _DECIMAL_COMMA.finditer(text):
        if not (m.start() and text[m.start() - 1].isupper()):
            add(f"{m.group(1)}.{m.group(2)}", False)
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
        Whether strings, numbers are grounded, and array items kept distinct.
    words, capitalise : bool
        Whether a grounded string starts and ends only at word edges, and whether it
        may also be a span of the :func:`capitalised` text (:func:`source_tables`).
    breaks : frozenset of int
        Offsets of characters no grounded string holds.

    Attributes
    ----------
    sensitivities : tuple of Sensitivity
        The tokens that could matter outside any array, and inside one (where a
        ``,`` may end a repeated item).
    """

    def __init__(self, text: str, index: TokenIndex, *, strings: bool, numbers: bool,
                 distinct: bool, words: bool = False, capitalise: bool = False,
                 breaks: frozenset[int] = frozenset()) -> None:
        self.text = text
        self.index = index
        self.sensitivities = (index.sensitivity(strings, numbers, False),
                              index.sensitivity(strings, numbers, distinct))
        self.escaped, self.boundary = source_tables(text, words=words, capitalise=capitalise,
                                                    breaks=breaks)
        self.live = _live(self.escaped, self.boundary)
        self.numbers = text_numbers(text)
        self.number_prefixes = frozenset(n[:k] for n in self.numbers for k in range(1, len(n) + 1))
        self.integers = frozenset(n for n in self.numbers if n.lstrip(b"-").isdigit())
        self.integer_prefixes = frozenset(n[:k] for n in self.integers
                                          for k in range(1, len(n) + 1))
        self._ends: dict[bytes, tuple[int, ...]] = {}
        self._spelled_cache: dict[bytes, tuple[np.ndarray, tuple]] = {}
        self._string_masks: dict[tuple, tuple[np.ndarray, np.ndarray | None]] = {}
        if strings:     # (made with the text, off the engine's step: the costly one)
            self._spelled(b"")
        self._number_masks: dict[tuple, tuple[np.ndarray, np.ndarray | None]] = {}

    # -- membership -----------------------------------------------------------------

    def ends(self, content: bytes) -> tuple[int, ...]:
        """Offsets in the escaped text where ``content`` ends, having started at a
        boundary (all boundaries for empty content). Cached."""
        found = self._ends.get(content)
        if found is not None:
            return found
        E, boundary = self.escaped, self.boundary
        if not content:
            found = tuple(k for k in range(len(E) + 1) if boundary[k] & START)
        else:
            out = []
            start = E.find(content)
            while start >= 0:
                if boundary[start] & START:
                    out.append(start + len(content))
                start = E.find(content, start + 1)
            found = tuple(out)
        if len(self._ends) >= _CACHE_LIMIT:
            self._ends.clear()
        self._ends[content] = found
        return found

    def has_string_prefix(self, content: bytes) -> bool:
        """Whether ``content`` (escaped) occurs in the text from a boundary, where it can
        still end."""
        live = self.live
        return any(live[e] for e in self.ends(content))

    def has_string(self, content: bytes) -> bool:
        """Whether ``content`` is a whole value: it occurs from a boundary to a boundary."""
        boundary = self.boundary
        return any(boundary[e] & STOP for e in self.ends(content))

    def has_number_prefix(self, written: bytes, integer: bool = False) -> bool:
        return written in (self.integer_prefixes if integer else self.number_prefixes)

    def has_number(self, written: bytes, integer: bool = False) -> bool:
        return written in (self.integers if integer else self.numbers)

    # -- masks ------------------------------------------------------------------------

    def _spelled(self, content: bytes) -> tuple[np.ndarray, tuple[tuple[int, int, int], ...]]:
        """For a grounded string whose content so far is ``content``: the ids of the
        tokens the text spells next, and (lo, hi, quote offset) slices of the sorted
        tokens it spells up to a boundary and then a closing quote. Cached."""
        found = self._spelled_cache.get(content)
        if found is not None:
            return found
        idx, E, boundary, live = self.index, self.escaped, self.boundary, self.live
        nodes, info, longest, size = idx.nodes, idx.node_info, idx.longest, len(E)
        ids: list[int] = []
        closes: set[tuple[int, int, int]] = set()
        more, close = ids.extend, closes.add
        root = (*idx.root_close, 0)
        for p in self.ends(content):
            if boundary[p] & STOP:
                close(root)
            stop = min(size, p + longest)
            k = p + 1
            while k <= stop:
                node = nodes.get(E[p:k])
                if node is None:
                    break
                if node:
                    spelled, closing = info[node]
                    if spelled and live[k]:
                        more(spelled)
                    if closing is not None and boundary[k] & STOP:
                        close((*closing, k - p))
                k += 1
        found = (np.asarray(ids, dtype=np.int64), tuple(closes))
        if len(self._spelled_cache) >= _CACHE_LIMIT:
            self._spelled_cache.clear()
        self._spelled_cache[content] = found
        return found

    def string_mask(self, content: bytes, sens: Sensitivity
                    ) -> tuple[np.ndarray, np.ndarray | None]:
        """For a grounded string whose content so far is ``content``: the bitmask row
        of the tokens allowed whatever follows their closing quote, and the row of
        closing tokens whose rest holds a byte that could matter (``sens``), to check
        one by one (None: none). Cached."""
        key = (content, sens.key)
        found = self._string_masks.get(key)
        if found is not None:
            return found
        idx = self.index
        ids, closes = self._spelled(content)
        last = sens.last
        allowed = [ids]
        check = []
        for lo, hi, q in closes:
            tids = idx.sorted_ids[lo:hi]
            late = last[tids] > q
            allowed.append(tids[~late])
            check.append(tids[late])
        check_ids = np.concatenate(check) if check else np.empty(0, dtype=np.int64)
        found = (idx.words_of(np.concatenate(allowed)),
                 idx.words_of(check_ids) if len(check_ids) else None)
        if len(self._string_masks) >= _CACHE_LIMIT:
            self._string_masks.clear()
        self._string_masks[key] = found
        return found

    def number_mask(self, written: bytes, sens: Sensitivity, integer: bool = False
                    ) -> tuple[np.ndarray, np.ndarray | None]:
        """As :meth:`string_mask`, for a grounded number written so far as ``written``:
        the tokens that keep it a prefix of one of the text's numbers (its whole
        numbers, for an ``integer``), and those that end it where it is whole (to check
        one by one when they go on)."""
        key = (written, sens.key, integer)
        found = self._number_masks.get(key)
        if found is not None:
            return found
        idx = self.index
        allowed: list[int] = []
        check: list[int] = []
        whole = False
        for number in self.integers if integer else self.numbers:
            if not number.startswith(written):
                continue
            rest = number[len(written):]
            if not rest:
                whole = True
                continue
            for k in range(1, len(rest) + 1):
                got = idx.by_bytes.get(rest[:k])
                if got is not None:
                    allowed.extend(got)
            lo, hi = idx.prefix_range(rest)
            for tid in idx.sorted_ids[lo:hi].tolist():
                b = idx.token_bytes[tid]
                if len(b) > len(rest) and b[len(rest)] not in _NUMBER_SET:
                    check.append(tid)
        allowed_words = idx.words_of(np.asarray(allowed, dtype=np.int64))
        check_words = idx.words_of(np.asarray(check, dtype=np.int64)) if check else None
        if whole:
            allowed_words = allowed_words | sens.ending_words
            check_words = sens.ending_check_words if check_words is None \
                else check_words | sens.ending_check_words
        found = (allowed_words, check_words)
        if len(self._number_masks) >= _CACHE_LIMIT:
            self._number_masks.clear()
        self._number_masks[key] = found
        return found
