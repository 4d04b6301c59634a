"""The accept of one token by each of a batch of xgrammar matchers, and its verdicts."""

from __future__ import annotations

import array
import ctypes
import itertools
import operator
from typing import TYPE_CHECKING

import numpy
import torch
import xgrammar as xgr

from formcast.engine.constraint import BatchAcceptor
from formcast.grammars.backends.xgrammar import ffi, native
from formcast.grammars.backends.xgrammar.tuning import XGrammarTuning
from formcast.grammars.backends.xgrammar.worker_jobs import (
    NativeAccept, PendingAccept, any_broken, backlog, settle_rows)

if TYPE_CHECKING:
    from formcast.grammars.backends.xgrammar.backend import XGrammarBackend
    from formcast.grammars.backends.xgrammar.matcher import XGrammarMatcher

TEXT = operator.attrgetter("_text")


def all_alike(items: list) -> bool:
    """Whether every one of ``items`` (not empty) equals the first: one C-level
    count, which compares by identity first (a batch's rows in step share the
    very text object)."""
    return items.count(items[0]) == len(items)


def offer(matchers: list[XGrammarMatcher], tokens: list[int]) -> list[int]:
    """Each of ``matchers`` offered its token in one xgrammar call (natively when
    this xgrammar allows): 1 taken, 0 refused."""
    if ffi.BATCH_ACCEPT is not None:
        return ffi.native_verdicts([m._handle for m in matchers], tokens)
    return [int(v) for v in xgr.BatchGrammarMatcher.batch_accept_token(
        [m._m for m in matchers], tokens)]


class PreparedAccept(BatchAcceptor):
    """The accept of one token by each of a fixed list of matchers, its
    per-matcher preparation done once (the native call's array of handles, the
    check that the matchers share one vocabulary): :meth:`XGrammarMatcher.
    accept_tokens` makes one per call, :meth:`XGrammarMatcher.batch_acceptor`
    one for as many steps as its rows run together. Calling it with a token
    per matcher changes their states; per row: 0 refused (state unchanged),
    1 taken, 2 taken and now terminated."""

    __slots__ = ("matchers", "handles", "one_vocabulary", "blocked", "size", "stops", "texts",
                 "one_text_rule", "masks", "tuning", "backend", "_cols")

    def __init__(self, matchers: list[XGrammarMatcher]) -> None:
        self.matchers = matchers
        self.handles = None
        self._cols: tuple[list[int], ctypes.Array] | None = None  # the last launch's columns
        self.one_vocabulary = False
        # the rows whose matcher keeps its text: few past the first tokens of an answer
        self.texts = [i for i, m in enumerate(matchers) if m._text is not None]
        self.one_text_rule = False
        self.masks = None  # the known masks of the one grammar of every matcher, if so
        self.tuning: XGrammarTuning = matchers[0]._tuning if matchers else XGrammarTuning()
        self.backend: XGrammarBackend | None = None
        if not matchers:
            return
        first = matchers[0]
        self.backend = getattr(first._origin, "backend", None)
        if first._origin is not None and all(m._origin is first._origin for m in matchers):
            self.masks = first._origin.text_masks
        # (a kept text grows by a token's bytes the same way for every row)
        self.one_text_rule = all(m._token_bytes is first._token_bytes and
                                 m._stops is first._stops for m in matchers)
        self.blocked, self.size, self.stops = first._blocked, first._size, first._stops
        self.one_vocabulary = all(m._blocked is self.blocked and m._size == self.size
                                  for m in matchers)
        if self.one_vocabulary and ffi.BATCH_ACCEPT is not None:
            self.handles = ffi.handle_array([m._handle for m in matchers])
        for m in matchers:
            m._moved = True

    def __del__(self, _release=ffi.release_later) -> None:  # (bound: the module may be gone)
        _release(getattr(self, "handles", None))

    def subset(self, rows: list[int]) -> PreparedAccept:
        """This accept for the matchers at ``rows`` (indices) alone: the rows a
        step offers their tokens when the others were sampled another way (under
        their masks), which change from step to step while the batch stays. Made
        from this preparation (its checks hold for any part of the matchers), at
        the cost of the native call's array of handles."""
        if not rows:
            return PreparedAccept([])
        part = PreparedAccept.__new__(PreparedAccept)
        part._cols = None
        matchers = self.matchers
        part.matchers = [matchers[i] for i in rows]
        part.one_vocabulary, part.one_text_rule = self.one_vocabulary, self.one_text_rule
        part.blocked, part.size, part.stops = self.blocked, self.size, self.stops
        part.masks, part.tuning, part.backend = self.masks, self.tuning, self.backend
        part.handles = None if self.handles is None else \
            ffi.handle_array([m._handle for m in part.matchers])
        part.texts = []
        if self.texts:  # (a matcher that let go of its text never keeps one again)
            self.texts = [i for i in self.texts if matchers[i]._text is not None]
            part.texts = [k for k, m in enumerate(part.matchers) if m._text is not None]
        return part

    def __call__(self, tokens: list[int]) -> list[int]:
        matchers = self.matchers
        if len(tokens) != len(matchers):
            raise ValueError(f"{len(tokens)} tokens for {len(matchers)} matchers")
        if not tokens:
            return []
        # the usual batch: matchers of one vocabulary, no token xgrammar must not
        # see, no stop token (so none can terminate): one pass, the checks in C
        usual = (self.one_vocabulary and min(tokens) >= 0 and max(tokens) < self.size
                 and self.blocked.isdisjoint(tokens) and self.stops.isdisjoint(tokens))
        tuning = self.tuning
        if usual and len(self.texts) >= tuning.known_min_rows and self.masks is not None \
                and self.handles is not None and tuning.text_masks:
            verdicts = self._on_known_masks(tokens)
            if verdicts is not None:
                return verdicts
        settle_rows(matchers)
        if any_broken(matchers):
            return self._without_broken(tokens)
        if usual:
            verdicts = ffi.native_verdicts(self.handles, tokens) if self.handles is not None \
                else offer(matchers, tokens)
            if self.texts:
                self.keep_texts(tokens, verdicts)
            return verdicts
        status = [0] * len(matchers)
        rows, inner, taken = [], [], []
        for i, (m, t) in enumerate(zip(matchers, tokens)):
            if m._may_offer(t):
                rows.append(i)
                inner.append(m)
                taken.append(t)
        if rows:
            for i, ok in zip(rows, offer(inner, taken)):
                if ok:
                    m = matchers[i]
                    # (matchers are made with terminate_without_stop_token=False)
                    if tokens[i] in m._stops and m._m.is_terminated():
                        status[i] = 2
                        m._end()
                    else:
                        status[i] = 1
        if self.texts:
            self.keep_texts(tokens, status)
        return status

    def _on_known_masks(self, tokens: list[int]) -> list[int] | None:
        """The usual batch, the rows whose text has a known mask (see
        :class:`~.text_masks.TextMasks`) judged by that mask's bit: the tokens
        they take go to xgrammar on the native worker (matchers that read their
        state wait for it), the other rows' are offered here. None (nothing
        done) when no row's text has a known mask, or no worker runs. Rows in
        step (a batch's opening) are worked out once per text and token."""
        pending = backlog()
        if pending is not None and pending.queue:
            pending.settle(done_only=True)  # (breaks a matcher xgrammar disagreed with)
        masks, matchers = self.masks, self.matchers
        worker = native.worker() if masks.rows is not None and self.one_text_rule else None
        if worker is None:
            return None
        get, n = masks.slots.get, len(matchers)
        kept = list(map(TEXT, matchers))
        in_step = all_alike(kept)  # (rows in step, a batch's opening)
        if in_step:
            slot = get(kept[0], -1)
            if slot < 0:
                return None
            slots = numpy.full(n, slot, numpy.int64)
            known = None
        else:
            slots = numpy.fromiter(map(get, kept, itertools.repeat(-1, n)), numpy.int64, n)
            known = slots >= 0
            if not known.any():
                return None
        host = array.array("q", tokens)  # (the worker's, with no dead-end flags)
        host.frombytes(bytes(8 * n))
        toks = numpy.frombuffer(host, dtype=numpy.int64, count=n)
        every = in_step or bool(known.all())
        if not every:
            slots, offered = slots[known], toks[known]
        else:
            offered = toks
        bits = (masks.rows[slots, offered >> 5].astype(numpy.int64) >> (offered & 31)) & 1
        if every:
            verdicts = bits.tolist()
            known_rows = None
        else:  # the other rows offered here, once the worker is through with them
            known_rows = numpy.flatnonzero(known)
            verdicts = [0] * n
            for i, bit in zip(known_rows.tolist(), bits.tolist()):
                verdicts[i] = bit
            self._offer_rows(numpy.flatnonzero(~known).tolist(), tokens, verdicts)
        took = bits.astype(bool)
        if not took.any():
            return verdicts
        # each (text, token) taken grows its text once
        rows_taken = numpy.flatnonzero(took) if every else known_rows[took]
        whole = len(rows_taken) == n
        size = self.size
        first: dict[int, int] = {}
        if whole and in_step and all_alike(tokens):  # (one text, one token)
            first[int(slots[0]) * size + tokens[0]] = 0
            back = None
        else:
            pairs = (slots * size + offered if whole else
                     slots[took] * size + offered[took]).tolist()
            back = [first.setdefault(pair, len(first)) for pair in pairs]
        grown, token_bytes, texts = [], matchers[0]._token_bytes, masks.texts
        limit = self.tuning.text_key_limit
        for pair in first:
            text = texts[pair // size] + token_bytes[pair % size]
            grown.append(text if len(text) <= limit else None)
        if whole:
            taken = matchers
        else:
            taken = [matchers[i] for i in rows_taken.tolist()]
            host = array.array("q", toks[rows_taken].tobytes())
            host.frombytes(bytes(8 * len(taken)))
        handles = self.handles if whole else ffi.handle_array([m._handle for m in taken])
        seq = worker.backlog.add(
            lambda seq: PendingAccept(seq, worker, handles, taken, host))
        if len(grown) == 1:
            text = grown[0]
            for m in taken:
                m._text = text
                m._pending = seq
        else:
            for m, at in zip(taken, back):
                m._text = grown[at]
                m._pending = seq
        if None in grown:  # (a matcher that lets go of its text never keeps one again)
            self.texts = [i for i in self.texts if matchers[i]._text is not None]
        return verdicts

    def _without_broken(self, tokens: list[int]) -> list[int]:
        """The verdicts when some matchers are broken (see :class:`PendingAccept`):
        -1 for those (their constraint failed), the others offered their tokens."""
        matchers = self.matchers
        verdicts = [-1] * len(matchers)
        ok = [i for i, m in enumerate(matchers) if m._broken is None]
        if ok:
            self._offer_rows(ok, tokens, verdicts)
        return verdicts

    def _offer_rows(self, rows: list[int], tokens: list[int], verdicts: list[int]) -> None:
        """Offer the matchers at ``rows`` their tokens through this accept's part
        for them (:meth:`subset`), their verdicts written into ``verdicts``."""
        part = self.subset(rows)
        for i, verdict in zip(rows, part([tokens[i] for i in rows])):
            verdicts[i] = verdict

    def launch(self, host: torch.Tensor, cols: list[int], query: tuple[int, int, int] | None
               ) -> NativeAccept | None:
        """This accept, of the tokens at columns ``cols`` of ``host`` (``[2, B]``
        int64 in host memory: the tokens, then each column's dead-end flag), on
        the native worker as soon as they land (``query``: the address of a C
        function, its argument and its not-ready code; it answers 0 once they
        have; None: landed already). Matcher ``k`` takes column ``cols[k]``. None
        when the worker cannot take it (no worker, matchers of several
        vocabularies, an xgrammar without the native accept): the caller offers
        the tokens itself. ``host`` must stay unchanged until the result is in."""
        if self.handles is None or not hasattr(self.handles, "__chandle__") or \
                len(cols) != len(self.matchers) or not cols:
            return None
        worker = native.worker()
        if worker is None:
            return None
        if host.dtype != torch.int64 or host.device.type != "cpu" or \
                not host.is_contiguous() or host.dim() != 2 or host.size(0) != 2:
            raise ValueError("host must be a contiguous [2, B] int64 tensor in host memory")
        return NativeAccept(self, worker, host, cols, query)

    def col_array(self, cols: list[int]) -> ctypes.Array:
        """``cols`` as int32 for the worker: the last launch's array when they are
        the same (a batch's steps offer the same columns while its rows stay)."""
        kept = self._cols
        if kept is None or kept[0] != cols:
            kind = ctypes.c_int32 * len(cols)
            # (through an array.array: cheaper than ctypes' own conversion)
            got = kind.from_buffer(array.array("i", cols)) if ffi.C_INT_IS_32 else kind(*cols)
            kept = self._cols = (list(cols), got)
        return kept[1]

    def special_bits(self) -> ctypes.Array:
        """The tokens the native worker must not offer (blocked, stop tokens), a bitmap."""
        return self.backend.special_bits()

    def keep_texts(self, tokens: list[int], verdicts: list[int]) -> None:
        """The texts of the rows that keep one grow by the tokens they took. Rows
        that kept the same text and took the same token (a batch's opening: the
        rows in step) share the grown text, made once."""
        matchers, kept = self.matchers, []
        grown: dict[tuple[bytes, int], bytes | None] | None = {} if self.one_text_rule else None
        for i in self.texts:
            m = matchers[i]
            text = m._text
            if text is not None and verdicts[i] > 0:
                key = (text, tokens[i])
                if grown is not None and key in grown:
                    text = m._text = grown[key]
                else:
                    m._took(tokens[i])
                    text = m._text
                    if grown is not None:
                        grown[key] = text
            if text is not None:
                kept.append(i)
        self.texts = kept
