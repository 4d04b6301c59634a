"""xgrammar backend: the default; compiles regex, JSON Schema, EBNF and Lark."""

from __future__ import annotations

import array
import ctypes
import itertools
import operator
import os
import re
import threading
import time

import numpy
import torch
import xgrammar as xgr

from formcast.grammars.errors import ConstraintError
from formcast.grammars.backends import native_accept
from formcast.grammars.backends.base import Backend, BackendGrammar, GrammarSource
from formcast.grammars.matcher import Matcher
from formcast.grammars.vocab import Vocabulary

# xgrammar prefixes C++ errors with "[hh:mm:ss] /path/file.cc:123: ".
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def library_message(exc: BaseException) -> str:
    """xgrammar's error text without its log prefix."""
    return _LOG_PREFIX.sub("", str(exc)).strip()


def _native_batch_accept():
    """xgrammar's native batch accept, if this xgrammar has the one we know.

    The public ``BatchGrammarMatcher.batch_accept_token`` turns the native result
    into a list one ``__getitem__`` at a time, about 2 us a row: as long as the
    native accept itself (256 rows: 0.5-0.6 ms of 1.1 ms on a 2-core host). A
    slice of the native array takes one plain call a row. None (the public method
    serves) when the private function is missing or answers differently."""
    core = getattr(getattr(xgr, "matcher", None), "_core", None)
    fn = getattr(getattr(core, "BatchGrammarMatcher", None), "batch_accept_token", None)
    if fn is None:
        return None
    try:
        if list(fn([], [], False)[:]) != []:
            return None
    except Exception:
        return None
    return fn


_NATIVE_BATCH_ACCEPT = _native_batch_accept()


def _quiet_global(name: str):
    """tvm-ffi's global function ``name`` as a private copy that keeps the
    interpreter lock through the call, or None when absent.

    tvm-ffi lets go of the lock around every call by default. For a call of a
    microsecond that is a loss whenever another thread wants the lock: getting
    it back then waits for that thread, up to a switch interval (on the H200's
    host, the accept thread reading its verdicts waits on the engine's main
    thread). A copy's setting is its own: the shared function keeps tvm-ffi's."""
    try:
        import tvm_ffi

        fn = tvm_ffi.get_global_func(name)  # (a new object each time)
        fn.release_gil = False
        return fn
    except Exception:
        return None


_STRINGIFY = _quiet_global("ffi.json.Stringify")  # (see _native_verdicts)
_CONTAINS = _quiet_global("ffi.ArrayContains")
_TO_ARRAY = _quiet_global("ffi.Array")
_DIGITS = bytes.maketrans(b"01", b"\x00\x01")


def _batch_accept(matchers: list["XGrammarMatcher"], tokens: list[int]) -> list[int]:
    """Each of ``matchers`` offered its token in one xgrammar call (natively when
    this xgrammar allows): 1 taken, 0 refused."""
    if _NATIVE_BATCH_ACCEPT is not None:
        return _native_verdicts([m._handle for m in matchers], tokens)
    return [int(v) for v in xgr.BatchGrammarMatcher.batch_accept_token(
        [m._m for m in matchers], tokens)]


def _native_verdicts(handles, tokens: list[int]) -> list[int]:
    """xgrammar's native batch accept of ``tokens`` by the matchers whose handles
    are ``handles`` (a list, or a tvm-ffi array of them): each row's verdict (1
    taken, 0 refused), in order.

    The native call lets go of the interpreter lock (tvm-ffi releases it around
    calls), but a batch split over threads gains little: on the H200's host 256
    rows in string states took 0.54 ms on one thread, 0.42 on two and 0.38 on
    four. So a batch is one call, which the engine overlaps with its other work
    rather than splitting. (Splitting it in the native worker was tried too:
    helper threads in C taking parts of the batch by a compare-and-swap, no
    interpreter in the hand-off, the parts accepted side by side at ~3x the
    speed of one thread. At 256 JSON rows on the H200, sides alternating in
    one process, medians of 6-8 runs a side, constrained throughput went from
    0.888 to 0.913 of free text's on one host and from 0.941 to 0.931 on
    another: inside the spread, and the opening's all-masked steps took as
    long as before. The accept is not what bounds those steps.)

    Its answer is a tvm-ffi array, read one call per element (0.4 us each
    here, as long as a row's accept): one containment test tells the usual
    batch, every row taken, and a batch with refusals is read through
    tvm-ffi's JSON writer ("[1,0,...]", in C) at half that cost, both calls
    keeping the lock (see :func:`_quiet_global`)."""
    got = _NATIVE_BATCH_ACCEPT(handles, tokens, False)
    n = len(tokens)
    if not (_CONTAINS(got, 0) if _CONTAINS is not None else 0 in got):
        return [1] * n
    if _STRINGIFY is not None:
        text = _STRINGIFY(got, None)
        if len(text) == 2 * n + 1:
            digits = text[1::2].encode().translate(_DIGITS)
            if max(digits) <= 1:
                return list(digits)
    return [int(v) for v in got[:]]


def _release_later(obj) -> None:
    """Let the native worker drop a reference to the tvm-ffi object ``obj`` (a
    matcher's handle, an array of them), called by its Python holder as it goes:
    a finished batch's last references then go there, and their destructors
    (256 xgrammar matchers: 2.4 ms on the H200's host, where the next batch
    dropped them, the device idle meanwhile) run off the engine's thread. Called
    from ``__del__``, which binds it (at interpreter exit the module's names
    may be gone before the objects): never raises."""
    try:
        if obj is None or not hasattr(obj, "__chandle__"):
            return
        worker = native_accept.started()  # (a matcher let go never builds or starts it)
        if worker is not None:
            worker.defer_release(obj)
    except Exception:
        pass


def _handle_array(matchers: list["XGrammarMatcher"]):
    """The native batch accept's argument for ``matchers``: their handles, as a
    tvm-ffi array when this tvm-ffi makes one (else a list)."""
    handles = [m._handle for m in matchers]
    return _TO_ARRAY(*handles) if _TO_ARRAY is not None else handles


_C_INT_IS_32 = array.array("i").itemsize == 4


class _PreparedAccept:
    """The accept of one token by each of a fixed list of matchers, its
    per-matcher preparation done once (the native call's array of handles, the
    check that the matchers share one vocabulary): :meth:`XGrammarMatcher.
    accept_tokens` makes one per call, :meth:`XGrammarMatcher.batch_acceptor`
    one for as many steps as its rows run together. Per row: 0 refused (state
    unchanged), 1 taken, 2 taken and now terminated."""

    __slots__ = ("matchers", "handles", "one_vocabulary", "blocked", "size", "stops", "texts",
                 "one_text_rule", "masks", "_cols")

    def __init__(self, matchers: list["XGrammarMatcher"]) -> None:
        self.matchers = matchers
        self.handles = None
        self._cols = None  # the columns of the last launch, as the worker reads them
        self.one_vocabulary = False
        # the rows whose matcher keeps its text (see XGrammarMatcher): few past
        # the first tokens of an answer
        self.texts = [i for i, m in enumerate(matchers) if m._text is not None]
        self.one_text_rule = False
        self.masks = None  # the known masks of the one grammar of every matcher, if so
        if not matchers:
            return
        first = matchers[0]
        if first._origin is not None and all(m._origin is first._origin for m in matchers):
            self.masks = first._origin.text_masks
        # (a kept text grows by a token's bytes the same way for every row)
        self.one_text_rule = all(m._token_bytes is first._token_bytes and
                                 m._stops is first._stops for m in matchers)
        self.blocked, self.size, self.stops = first._blocked, first._size, first._stops
        self.one_vocabulary = all(m._blocked is self.blocked and m._size == self.size
                                  for m in matchers)
        if self.one_vocabulary and _NATIVE_BATCH_ACCEPT is not None:
            self.handles = _handle_array(matchers)
        for m in matchers:
            m._moved = True

    def __del__(self, _release=_release_later) -> None:  # (bound: the module may be gone)
        _release(getattr(self, "handles", None))

    def subset(self, rows: list[int]) -> "_PreparedAccept":
        """This accept for the matchers at ``rows`` (indices) alone: the rows a
        step offers their tokens when the others were sampled another way (under
        their masks), which change from step to step while the batch stays. Made
        from this preparation (its checks hold for any part of the matchers), at
        the cost of the native call's array of handles."""
        if not rows:
            return _PreparedAccept([])
        part = _PreparedAccept.__new__(_PreparedAccept)
        part._cols = None
        matchers = self.matchers
        part.matchers = [matchers[i] for i in rows]
        part.one_vocabulary, part.one_text_rule = self.one_vocabulary, self.one_text_rule
        part.blocked, part.size, part.stops = self.blocked, self.size, self.stops
        part.masks = self.masks
        part.handles = None if self.handles is None else _handle_array(part.matchers)
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
        if usual and len(self.texts) >= KNOWN_MIN_ROWS and self.masks is not None \
                and self.handles is not None and TEXT_MASKS:
            verdicts = self._on_known_masks(tokens)
            if verdicts is not None:
                return verdicts
        _settle_rows(matchers)
        if _UNSETTLED.broken and any(m._broken is not None for m in matchers):
            return self._without_broken(tokens)
        if usual:
            verdicts = _native_verdicts(self.handles, tokens) if self.handles is not None \
                else _batch_accept(matchers, tokens)
            if self.texts:
                self._keep_texts(tokens, verdicts)
            return verdicts
        status = [0] * len(matchers)
        rows, inner, taken = [], [], []
        for i, (m, t) in enumerate(zip(matchers, tokens)):
            if m._may_offer(t):
                rows.append(i)
                inner.append(m)
                taken.append(t)
        if rows:
            for i, ok in zip(rows, _batch_accept(inner, taken)):
                if ok:
                    m = matchers[i]
                    # (matchers are made with terminate_without_stop_token=False)
                    status[i] = 2 if tokens[i] in m._stops and m._m.is_terminated() else 1
        if self.texts:
            self._keep_texts(tokens, status)
        return status

    def _on_known_masks(self, tokens: list[int]) -> list[int] | None:
        """The usual batch, the rows whose text has a known mask (see
        :class:`_TextMasks`) judged by that mask's bit: the tokens they take go
        to xgrammar on the native worker (matchers that read their state wait
        for it), the other rows' are offered here. None (nothing done) when no
        row's text has a known mask, or no worker runs.

        Rows in step (a batch's opening: 256 rows, a dozen texts) are worked
        out once per text and token: on the H200's host 256 rows took ~0.14 ms
        here against 0.25-0.6 ms of xgrammar's accept."""
        unsettled = _UNSETTLED
        if unsettled.queue:
            unsettled.settle(done_only=True)  # (breaks a matcher xgrammar disagreed with)
        masks, matchers = self.masks, self.matchers
        worker = native_accept.worker() if masks.rows is not None and self.one_text_rule \
            else None
        if worker is None:
            return None
        get, n = masks.slots.get, len(matchers)
        kept = list(map(_TEXT, matchers))
        in_step = _all_alike(kept)  # (rows in step, a batch's opening)
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
        host = array.array("q", tokens)  # (the worker's, with no dead-end flags: see _Pending)
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
        if whole and in_step and _all_alike(tokens):  # (one text, one token)
            first[int(slots[0]) * size + tokens[0]] = 0
            back = None
        else:
            pairs = (slots * size + offered if whole else
                     slots[took] * size + offered[took]).tolist()
            back = [first.setdefault(pair, len(first)) for pair in pairs]
        grown, token_bytes, texts = [], matchers[0]._token_bytes, masks.texts
        for pair in first:
            text = texts[pair // size] + token_bytes[pair % size]
            grown.append(text if len(text) <= TEXT_KEY_LIMIT else None)
        if whole:
            taken = matchers
        else:
            taken = [matchers[i] for i in rows_taken.tolist()]
            host = array.array("q", toks[rows_taken].tobytes())
            host.frombytes(bytes(8 * len(taken)))
        seq = unsettled.submit(worker, self.handles if whole else _handle_array(taken), taken,
                               host)
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
        """The verdicts when some matchers are broken (see :class:`_Pending`): -1
        for those (their constraint failed), the others offered their tokens."""
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
               ) -> "_NativeAccept | None":
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
        worker = native_accept.worker()
        if worker is None:
            return None
        if host.dtype != torch.int64 or host.device.type != "cpu" or \
                not host.is_contiguous() or host.dim() != 2 or host.size(0) != 2:
            raise ValueError("host must be a contiguous [2, B] int64 tensor in host memory")
        return _NativeAccept(self, worker, host, cols, query)

    def _col_array(self, cols: list[int]) -> ctypes.Array:
        """``cols`` as int32 for the worker: the last launch's array when they are
        the same (a batch's steps offer the same columns while its rows stay)."""
        kept = self._cols
        if kept is None or kept[0] != cols:
            kind = ctypes.c_int32 * len(cols)
            # (through an array.array: a quarter of the time of ctypes' own conversion)
            got = kind.from_buffer(array.array("i", cols)) if _C_INT_IS_32 else kind(*cols)
            kept = self._cols = (list(cols), got)
        return kept[1]

    def _special_bits(self) -> ctypes.Array:
        """The tokens the native worker must not offer (blocked, stop tokens), a bitmap."""
        key = (id(self.blocked), id(self.stops), self.size)
        kept = _SPECIAL_BITS.get(key)
        if kept is None:
            bits = bytearray((self.size + 7) // 8)
            for t in self.blocked | self.stops:
                if 0 <= t < self.size:
                    bits[t >> 3] |= 1 << (t & 7)
            # (the sets themselves kept too: their ids stay theirs)
            kept = _SPECIAL_BITS[key] = (self.blocked, self.stops,
                                         (ctypes.c_uint8 * len(bits)).from_buffer(bits))
        return kept[2]

    def _keep_texts(self, tokens: list[int], verdicts: list[int]) -> None:
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


_SPECIAL_BITS: dict[tuple[int, int, int], tuple] = {}
_TEXT, _ORIGIN = operator.attrgetter("_text"), operator.attrgetter("_origin")


def _all_alike(items: list) -> bool:
    """Whether every one of ``items`` (not empty) equals the first: one C-level
    count, which compares by identity first (a batch's rows in step share the
    very text object)."""
    return items.count(items[0]) == len(items)


class _NativeAccept:
    """A :class:`_PreparedAccept` of one step's tokens on the native worker
    (:meth:`_PreparedAccept.launch`): ``result()`` is the verdicts, as the
    prepared accept's call gives them, or None when a column's dead-end flag is
    set (no matcher moved); ``done()`` whether the worker is through with it."""

    __slots__ = ("part", "worker", "host", "cols", "job", "_keep", "_outcome")

    def __init__(self, part: _PreparedAccept, worker, host: torch.Tensor, cols: list[int],
                 query: tuple[int, int, int] | None) -> None:
        self.part, self.worker, self.host, self.cols = part, worker, host, cols
        n = len(cols)
        col_array = part._col_array(cols)
        verdicts = (ctypes.c_int8 * n)()
        special = part._special_bits()
        job = self.job = native_accept.Job(
            fn=_NATIVE_BATCH_ACCEPT.__chandle__(), handles=part.handles.__chandle__(),
            host=host.data_ptr(), stride=host.size(1), cols=ctypes.addressof(col_array), n=n,
            vocab=part.size, special=ctypes.addressof(special),
            verdicts=ctypes.addressof(verdicts))
        if query is not None:
            job.query, job.query_arg, job.not_ready = query
            job.poll_pauses = native_accept.POLL_PAUSES
        # (what the worker reads, alive until it is done)
        self._keep = (col_array, verdicts, special, part.handles)
        self._outcome = None
        worker.submit(job)

    def done(self) -> bool:
        return self.job.state != native_accept.QUEUED

    def wait(self) -> None:
        """Until the worker is through with the matchers (no result read)."""
        self.worker.wait(self.job)

    def result(self) -> list[int] | None:
        if self._outcome is None:
            self._outcome = self._finish(self.worker.wait(self.job))
        return self._outcome[0]

    def _finish(self, state: int) -> tuple[list[int] | None]:
        if state == native_accept.DEAD:
            return (None,)
        if state == native_accept.ERROR:
            raise RuntimeError(library_message(RuntimeError(
                self.job.error.decode("utf-8", "replace"))))
        part = self.part
        tokens = None
        if state == native_accept.SLOW or part.texts:
            row = self.host[0].tolist()
            tokens = [row[c] for c in self.cols]
        if state == native_accept.SLOW:  # (no matcher moved: the ordinary way)
            return (part(tokens),)
        verdicts = list(bytes(self._keep[1]))
        if part.texts:
            part._keep_texts(tokens, verdicts)
        return (verdicts,)


class _TextMasks:
    """The masks of the states one grammar's matchers reach on short texts, by
    the text (a grammar's state after some bytes depends on those bytes alone,
    not on the tokens that brought them: see :func:`batch_fill`).

    What it buys is a batch's opening. Every row of a batch of one schema is
    masked while the grammar forces its first text ('{"records":[{"name":"'),
    and each step's masks depend on the picks of the step before: on the
    H200's host the accept of 256 masked picks (0.25-0.6 ms, the matchers'
    states cold in the caches) and the fill of their few states lay on that
    path, the device idle meanwhile. With the masks of those texts known, a
    masked pick's verdict is a bit of its text's mask, the next mask a copy of
    a known row, and xgrammar takes the tokens on the native worker, off the
    path (see :class:`_PreparedAccept`). Rows are added as matchers fill masks
    for texts not known yet, up to ``ROWS`` (the openings of a grammar's
    answers come first: the rows that follow are mostly one answer's own
    string; the schema of ``gpu_throughput.py`` forces 22 bytes)."""

    ROWS = 128

    __slots__ = ("slots", "texts", "rows", "words", "_lock")

    def __init__(self, words: int) -> None:
        self.slots: dict[bytes, int] = {}  # text -> its row in ``rows``
        self.texts: list[bytes] = []       # row -> its text
        self.rows = None                   # numpy int32 [ROWS, words], made on first use
        self.words = words                 # (masks of another width are not kept)
        self._lock = threading.Lock()

    @property
    def memory_bytes(self) -> int:
        return self.ROWS * self.words * 4

    def row(self, text: bytes | None, words: int) -> int | None:
        """The row of ``text``'s mask, for masks ``words`` wide; None when not known."""
        return self.slots.get(text) if words == self.words else None

    def add(self, text: bytes | None, mask) -> None:
        """Keep ``mask`` (a numpy int32 row) as ``text``'s, while there is room."""
        if text is None or text in self.slots:
            return
        with self._lock:
            at = len(self.slots)
            if len(mask) != self.words or at >= self.ROWS or text in self.slots:
                return
            if self.rows is None:
                self.rows = numpy.empty((self.ROWS, self.words), dtype=numpy.int32)
            self.rows[at] = mask
            self.texts.append(text)
            self.slots[text] = at  # (after the row is written: readers take no lock)


class _Pending:
    """Tokens that matchers took on their texts' known masks (see
    :class:`_TextMasks`), being offered to xgrammar on the native worker. The
    matchers are in step with their texts once it is settled (:meth:`_Unsettled.settle`);
    a token xgrammar refuses there (its mask allowed it: never seen) breaks its
    matcher, which raises from then on, so its request fails with the reason
    rather than going on from a state that is not its text's."""

    __slots__ = ("seq", "job", "worker", "matchers", "tokens", "_keep")

    def __init__(self, seq: int, worker, handles, matchers: list["XGrammarMatcher"],
                 tokens: array.array) -> None:
        n = len(matchers)
        self.seq, self.worker, self.matchers, self.tokens = seq, worker, matchers, tokens
        host = tokens  # (the worker reads [2, n]: the tokens, then the dead-end flags)
        cols = _identity_cols(n)
        verdicts = bytearray(n)
        job = self.job = native_accept.Job()
        job.fn, job.handles = _NATIVE_BATCH_ACCEPT.__chandle__(), handles.__chandle__()
        job.host, job.stride, job.n = host.buffer_info()[0], n, n
        job.cols, job.vocab = ctypes.addressof(cols), 1 << 62
        keep = (ctypes.c_int8 * n).from_buffer(verdicts)
        job.verdicts = ctypes.addressof(keep)
        self._keep = (host, cols, verdicts, keep, handles)  # (what the worker reads)
        worker.submit(job)

    def __del__(self, _release=_release_later) -> None:  # (bound: the module may be gone)
        keep = getattr(self, "_keep", None)  # (none when the submit failed first)
        _release(keep[4] if keep else None)  # (the handles, maybe the last reference)

    def finish(self) -> None:
        """Wait for the worker, then break the matchers whose token it refused."""
        state = self.worker.wait(self.job)
        if state == native_accept.DONE:
            verdicts = bytes(self._keep[2])
            if verdicts.count(1) == len(verdicts):
                return
            for m, t, v in zip(self.matchers, self.tokens, verdicts):
                if not v:
                    m._broken = (f"xgrammar refused token {t} after its mask for the text "
                                 "before allowed it")
                    _UNSETTLED.broken += 1
            return
        reason = self.job.error.decode("utf-8", "replace") if state == native_accept.ERROR \
            else f"the native worker answered state {state}"
        why = library_message(RuntimeError(reason))
        for m in self.matchers:
            m._broken = f"taking a token on the native worker failed: {why}"
        _UNSETTLED.broken += len(self.matchers)


_COLS: dict[int, ctypes.Array] = {}


def _identity_cols(n: int) -> ctypes.Array:
    """``0..n-1`` as int32 for the worker (kept: a batch offers the same count)."""
    cols = _COLS.get(n)
    if cols is None:
        cols = _COLS[n] = (ctypes.c_int32 * n)(*range(n))
    return cols


class _Unsettled:
    """The :class:`_Pending` batches not checked yet, oldest first (the worker
    takes them in order), and the number of the last one submitted."""

    def __init__(self) -> None:
        self.queue: list[_Pending] = []
        self.last = 0      # the number of the last batch submitted
        self.settled = 0   # every batch up to this number is settled
        self.broken = 0    # matchers broken so far (see _Pending)
        self.lock = threading.Lock()

    def submit(self, worker, handles, matchers: list["XGrammarMatcher"], tokens: array.array
               ) -> int:
        """Queue ``matchers`` taking ``tokens`` (int64, then as many zeros: the
        worker's dead-end flags; taken over) on the worker: the batch's number,
        which the caller sets as each matcher's ``_pending``."""
        with self.lock:
            self.last += 1
            seq = self.last
            self.queue.append(_Pending(seq, worker, handles, matchers, tokens))
        return seq

    def settle(self, through: int | None = None, *, done_only: bool = False) -> None:
        """Check the batches up to number ``through`` (None: all), waiting for the
        worker; ``done_only``: only those the worker is through with, no wait."""
        with self.lock:
            queue = self.queue
            while queue and (through is None or queue[0].seq <= through):
                first = queue[0]
                if done_only and first.job.state == native_accept.QUEUED:
                    break
                first.finish()
                queue.pop(0)
                self.settled = first.seq


_UNSETTLED = _Unsettled()
_FORK_LOCK = threading.Lock()  # (see XGrammarMatcher._fork)

# whether matchers take tokens on their texts' known masks (see _TextMasks): off
# for comparisons
TEXT_MASKS = os.environ.get("FORMCAST_TEXT_MASKS", "1") != "0"
# ... for batches of at least this many rows that keep their texts. A few
# masked rows among unmasked ones (a large batch past its opening) are taken
# here: the worker is then checking the unmasked rows' picks, and a fill that
# needs one of the few rows' state would wait for that check too (on the
# H200's host 0.3-0.5 ms, twice a run at 256 rows, with three rows taken there)
KNOWN_MIN_ROWS = 16


def _settle_rows(matchers: list["XGrammarMatcher"]) -> None:
    """Wait until xgrammar took the tokens that any of ``matchers`` took on
    known masks (their states then read as their texts')."""
    unsettled = _UNSETTLED
    if unsettled.last != unsettled.settled:
        through = max(m._pending for m in matchers)
        if through > unsettled.settled:
            unsettled.settle(through)


class XGrammarBackend(Backend):
    name = "xgrammar"
    kinds = frozenset({"regex", "json_schema", "ebnf", "lark"})

    def __init__(self, vocab: Vocabulary) -> None:
        super().__init__(vocab)
        self.tokenizer_info = xgr.TokenizerInfo(
            list(vocab.token_bytes), xgr.VocabType.RAW, vocab_size=vocab.vocab_size,
            stop_token_ids=sorted(vocab.eos_token_ids), add_prefix_space=False)
        # formcast's compile cache is the one cache; xgrammar's own would double-count.
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info,
                                            max_threads=min(8, os.cpu_count() or 1),
                                            cache_enabled=False)
        # Non-stop special tokens (and padding) are never allowed; checking them here
        # keeps xgrammar from logging a warning for each such accept.
        self.blocked = frozenset(vocab.special_token_ids - vocab.eos_token_ids)
        self.stops = frozenset(vocab.eos_token_ids)

    def compile(self, source: GrammarSource) -> XGrammarGrammar:
        try:
            if source.kind == "regex":
                compiled = self.compiler.compile_regex(source.text)
            elif source.kind == "json_schema":
                ws = source.max_whitespace
                compiled = self.compiler.compile_json_schema(
                    source.text, any_whitespace=ws > 0, separators=(",", ":"),
                    max_whitespace_cnt=ws if ws > 0 else None, strict_mode=True)
            elif source.kind == "ebnf":
                grammar = xgr.Grammar.from_ebnf(source.text, root_rule_name=source.root)
                compiled = self.compiler.compile_grammar(grammar)
            elif source.kind == "lark":
                compiled = self.compiler.compile_grammar(xgr.Grammar.from_lark(source.text))
            else:
                raise ConstraintError(f"xgrammar backend cannot compile {source.kind!r}")
        except RuntimeError as exc:
            raise ConstraintError(f"{source.kind}: {library_message(exc)}") from None
        return XGrammarGrammar(compiled, self)


class XGrammarGrammar(BackendGrammar):
    def __init__(self, compiled: xgr.CompiledGrammar, backend: XGrammarBackend) -> None:
        self.compiled = compiled
        self.backend = backend
        # a matcher at the grammar's start that never moves: new matchers are its
        # forks (a copy of its state: 2 us here, against 4.5 us for xgrammar's
        # constructor and its checks; a batch of 256 requests makes 256)
        self._start: xgr.GrammarMatcher | None = None
        # kept text -> whether the grammar fixes the next text there (see
        # XGrammarMatcher.forces_text): held by the grammar, so it goes with it
        self.forced_texts: dict[bytes, bool] = {}
        # kept text -> whether the grammar allows few tokens there (see
        # XGrammarMatcher.narrow_choice)
        self.narrow_texts: dict[bytes, bool] = {}
        # kept text -> the mask of the state it leads to (see _TextMasks)
        self.text_masks = _TextMasks((backend.tokenizer_info.vocab_size + 31) // 32)
        # the tokens the grammar fixes at its start, a matcher that took them
        # (forks of it are new matchers that took them too) and their text
        self._opening: tuple[tuple[int, ...], xgr.GrammarMatcher, bytes] | None = None

    @property
    def memory_bytes(self) -> int:
        return int(self.compiled.memory_size_bytes) + self.text_masks.memory_bytes

    def opening(self) -> tuple[tuple[int, ...], xgr.GrammarMatcher, bytes]:
        """The tokens the grammar fixes at its start (xgrammar's jump-forward
        tokens there), a matcher that took them, and their text; found once."""
        got = self._opening
        if got is None:
            with _FORK_LOCK:
                m = self._start.fork()
            taken: list[int] = []
            for token in m.find_jump_forward_tokens():
                if not m.accept_token(token):
                    break
                taken.append(token)
            data = self.backend.vocab.token_bytes
            got = self._opening = (tuple(taken), m, b"".join(data[t] for t in taken))
        return got

    def matcher(self) -> XGrammarMatcher:
        start = self._start
        if start is None:
            start = self._start = xgr.GrammarMatcher(self.compiled)
        backend = self.backend
        return XGrammarMatcher(None, backend.blocked, backend.vocab.tokenizer_size,
                               backend.stops, token_bytes=backend.vocab.token_bytes, origin=self)


class XGrammarMatcher(Matcher):
    """A thin shell over ``xgrammar.GrammarMatcher``.

    ``fill_bitmask`` is xgrammar's own bound method, set per instance, so the engine's
    per-token call costs exactly what a direct xgrammar call does (it returns
    xgrammar's "needs applying" flag, which callers may ignore).

    While a matcher has taken little text it keeps that text (``_text``, up to
    ``TEXT_KEY_LIMIT`` bytes; None after, or after a rollback or a stop token):
    the matchers of one grammar (``_origin``) that took the same text are in
    the same state, so a batch fill fills one of them and copies its mask to
    the others (see :func:`batch_fill`), or the engine reads its row for them
    (:func:`fill_distinct`).

    A matcher whose kept text has a known mask (:class:`_TextMasks`) may take
    a token on that mask alone, xgrammar taking it later on the native worker
    (``_pending``: the number of that batch, see :class:`_Unsettled`): every
    method that reads xgrammar's state waits for it first (:meth:`_sync`).

    A matcher made with none (``matcher`` None) forks its xgrammar matcher
    from its grammar's (``origin``) start state on first use (``_m``, ``_accept``,
    ``_handle``), or when the engine offers a batch's new matchers to
    :meth:`prepare` while the device runs their prefill. (``gpu_throughput.py``
    makes a batch's 256 matchers before its engine starts, the device idle:
    1.26 ms on our CPU with a fork each, 0.84 ms without; py-spy on an H100's
    host put 1.4 ms of its 2.3 ms in xgrammar's fork.)
    """

    # (slots: a batch's opening reads every row's text each step, its objects cold)
    __slots__ = ("_xm", "_blocked", "_size", "_stops", "_moved", "_token_bytes", "_origin",
                 "_text", "_xaccept", "_xhandle", "_pending", "_broken", "_recipe", "_source")

    def __init__(self, matcher: xgr.GrammarMatcher | None, blocked: frozenset[int], size: int,
                 stops: frozenset[int], *, token_bytes: tuple[bytes, ...] | None = None,
                 origin: object = None, text: bytes | None = b"") -> None:
        if matcher is None and getattr(origin, "_start", None) is None:
            raise ValueError("XGrammarMatcher needs an xgrammar matcher or a grammar's start "
                             "to fork")
        self._xm = self._xaccept = self._xhandle = None
        if matcher is not None:
            self._own(matcher)
        self._blocked = blocked
        self._size = size
        self._stops = stops  # xgrammar's stop tokens: only accepting one ends a matcher
        self._moved = False  # a token or text was offered (see Matcher._is_fresh)
        self._token_bytes = token_bytes
        self._origin = origin
        self._text = text if token_bytes is not None and origin is not None else None
        self._pending = 0     # the last batch of tokens it takes on the worker (_Unsettled)
        self._broken = None   # why its state is not its text's (see _Pending)
        self._source = None   # what it forks from when not its grammar's start

    def __del__(self, _release=_release_later) -> None:  # (bound: the module may be gone)
        _release(getattr(self, "_xhandle", None))  # (xgrammar's matcher dies on the worker)

    def _own(self, matcher: xgr.GrammarMatcher) -> None:
        self._xaccept = matcher.accept_token
        self._xhandle = getattr(matcher, "_handle", None)  # (for the native batch accept)
        self._xm = matcher  # (last: a thread that sees it sees the others)

    def _fork_unlocked(self) -> None:
        if self._xm is None:
            source = self._source
            self._own((source if source is not None else self._origin._start).fork())

    def _fork(self) -> xgr.GrammarMatcher:
        """Its xgrammar matcher, forked from its grammar's start now if not yet
        (under a lock: the engine's mask thread may want it at the same time)."""
        with _FORK_LOCK:
            self._fork_unlocked()
        return self._xm

    @staticmethod
    def prepare(matchers: list[XGrammarMatcher]) -> None:
        """Fork the xgrammar matchers of those of ``matchers`` that have none yet
        (the engine's optional hook, offered a step's new constraints while the
        device runs their prefill)."""
        with _FORK_LOCK:
            for m in matchers:
                m._fork_unlocked()

    @property
    def _m(self) -> xgr.GrammarMatcher:
        m = self._xm
        return m if m is not None else self._fork()

    @property
    def _accept(self):
        if self._xm is None:
            self._fork()
        return self._xaccept

    @property
    def _handle(self):
        if self._xm is None:
            self._fork()
        return self._xhandle

    def _sync(self) -> None:
        """Wait until xgrammar took the tokens this matcher took on known masks;
        raises when one broke it (see :class:`_Pending`)."""
        if self._pending > _UNSETTLED.settled:
            _UNSETTLED.settle(self._pending)
        if self._broken is not None:
            raise RuntimeError(self._broken)

    def _known_mask(self, width: int):
        """Its kept text's known mask (a numpy int32 row ``width`` words wide, see
        :class:`_TextMasks`), or None."""
        text = self._text
        if text is None or self._broken is not None or not TEXT_MASKS:
            return None
        masks = self._origin.text_masks
        at = masks.row(text, width)
        return None if at is None else masks.rows[at]

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        known = self._known_mask(bitmask.shape[1])
        if known is not None:
            bitmask[row] = torch.from_numpy(known)
            return
        self._sync()
        self._m.fill_next_token_bitmask(bitmask, row)
        if self._text is not None and TEXT_MASKS and bitmask.device.type == "cpu":
            self._origin.text_masks.add(self._text, bitmask[row].numpy())

    @staticmethod
    def tidy() -> None:
        """Housekeeping the engine offers while it waits for the device (its
        optional hook): the batches of tokens the native worker is through with
        are checked and let go. A finished batch's matchers, when those held
        their last references, are destroyed here then, rather than at the next
        batch's first accept (256 matchers: 1.5-2.4 ms on the H200's host)."""
        if _UNSETTLED.queue:
            _UNSETTLED.settle(done_only=True)

    @staticmethod
    def fill_bitmasks(matchers: list["XGrammarMatcher"], bitmask: torch.Tensor,
                      rows: list[int]) -> None:
        """Several matchers' rows in one call (the engine's optional batch hook)."""
        batch_fill(matchers, bitmask, rows)

    @staticmethod
    def fill_distinct_bitmasks(matchers: list["XGrammarMatcher"], bitmask: torch.Tensor
                               ) -> list[int] | None:
        """One mask row per distinct state, rows ``0..k-1``, and the row of each
        matcher (the engine's optional batch hook; see :func:`fill_distinct`)."""
        return fill_distinct(matchers, bitmask)

    @staticmethod
    def accept_tokens(matchers: list["XGrammarMatcher"], tokens: list[int]) -> list[int]:
        """Advance each matcher by its token, the xgrammar part in one native call
        (the engine's optional batch hook). Per row: 0 refused (state unchanged),
        1 taken, 2 taken and now terminated."""
        return _PreparedAccept(matchers)(tokens)

    @staticmethod
    def batch_acceptor(matchers: list["XGrammarMatcher"]) -> _PreparedAccept:
        """:meth:`accept_tokens` for these matchers, prepared once for as many
        steps as they run together (the engine's optional batch hook)."""
        return _PreparedAccept(matchers)

    def _is_fresh(self) -> bool:
        return not self._moved

    def _may_offer(self, token_id: int) -> bool:
        """Whether ``token_id`` may go to xgrammar at all (not a blocked special
        token, inside the tokenizer's ids)."""
        return token_id not in self._blocked and 0 <= token_id < self._size

    def accept(self, token_id: int) -> bool:
        if not self._may_offer(token_id):
            return False
        self._moved = True
        self._sync()
        taken = self._accept(token_id)
        if taken and self._text is not None:
            self._took(token_id)
        return taken

    def accept_text(self, text: str) -> bool:
        self._moved = True
        self._sync()
        taken = self._m.accept_string(text)
        if self._text is not None:
            self._grow_text(text.encode("utf-8") if taken else None)
        return taken

    def _took(self, token_id: int) -> None:
        """Keep the text of a token just taken (a stop token: a state of its own)."""
        self._grow_text(None if token_id in self._stops else self._token_bytes[token_id])

    def _grow_text(self, data: bytes | None) -> None:
        """The kept text with ``data`` after it, while short; None: no longer kept."""
        grown = None if data is None else self._text + data
        self._text = grown if grown is not None and len(grown) <= TEXT_KEY_LIMIT else None

    def rollback(self, num_tokens: int) -> None:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if num_tokens:
            self._sync()
            self._text = None  # (the text before is not kept)
            try:
                self._m.rollback(num_tokens)
            except RuntimeError as exc:
                raise ValueError(library_message(exc)) from None

    def is_terminated(self) -> bool:
        self._sync()
        return self._m.is_terminated()

    def is_completed(self) -> bool:
        self._sync()
        return self._m.is_completed()

    def forced_tokens(self) -> list[int]:
        self._sync()
        return self._m.find_jump_forward_tokens()

    def take_forced_tokens(self, limit: int) -> list[int]:
        """A new matcher not forked yet takes the tokens its grammar fixes at
        its start by pointing its fork at a matcher that took them (see
        :meth:`XGrammarGrammar.opening`): no xgrammar call for a batch's 256
        requests as they are queued. Otherwise as :meth:`Matcher.take_forced_tokens`."""
        origin = self._origin
        if self._xm is None and not self._moved and origin is not None:
            tokens, source, data = origin.opening()
            if len(tokens) <= limit:
                if tokens:
                    self._moved = True
                    self._source = source
                    if self._text is not None:
                        self._grow_text(data)
                return list(tokens)
        return super().take_forced_tokens(limit)

    def forces_text(self) -> bool:
        """Whether the grammar fixes the next bytes of text, whatever the model
        writes (the engine's optional hook: a model's unmasked argmax that equals
        its masked pick there shows nothing of how well it follows the grammar).
        Matchers of one grammar that took the same kept text share the answer,
        found once (a batch's opening asks it of every row)."""
        return self._by_text("forced_texts", self._forces_text_now)

    def _forces_text_now(self) -> bool:
        self._sync()
        return bool(self._m.find_jump_forward_string())

    def narrow_choice(self) -> bool:
        """Whether the grammar allows fewer than half of the vocabulary's tokens
        next (the engine's optional hook): punctuation, a key, a number's digits,
        rather than a string's inside, where nearly every token goes. A masked
        row's agreement with its model there shows little, and an unmasked pick
        there is often refused (a model of random weights writing `88` where the
        schema's integer stops at 120 picks `8` again). Matchers of one grammar
        that took the same kept text share the answer, found once."""
        if self._origin is None:  # (no grammar to size its mask by: forced text alone)
            return self.forces_text()
        return self._by_text("narrow_texts", self._narrow_choice_now)

    def _narrow_choice_now(self) -> bool:
        width = self._origin.text_masks.words
        words = self._known_mask(width)
        if words is None:
            self._sync()
            mask = torch.zeros(1, width, dtype=torch.int32)
            self._m.fill_next_token_bitmask(mask, 0)
            words = mask.numpy()[0]
        return 2 * int.from_bytes(words.tobytes(), "little").bit_count() < self._size

    def _by_text(self, cache: str, answer) -> bool:
        """``answer()``, kept in the grammar's dict ``cache`` under this matcher's
        kept text (matchers that took the same text are in the same state);
        asked afresh when it keeps none."""
        text = self._text
        known = getattr(self._origin, cache, None) if text is not None else None
        if known is None:
            return answer()
        got = known.get(text)
        if got is None:
            if len(known) >= 4096:
                known.clear()
            got = known[text] = answer()
        return got

    def fork(self) -> XGrammarMatcher:
        matcher = None  # (still at its grammar's start, never forked: the copy forks when used)
        if self._xm is not None:
            self._sync()
            matcher = self._xm.fork()
        return XGrammarMatcher(matcher, self._blocked, self._size, self._stops,
                               token_bytes=self._token_bytes, origin=self._origin,
                               text=self._text)

    @property
    def xgrammar_matcher(self) -> xgr.GrammarMatcher:
        """The wrapped xgrammar matcher (for batch filling), in step with its text."""
        self._sync()
        return self._m


class _FillPlan:
    """Whether a batch of masks is filled on one thread or spread over a few.

    xgrammar's threads pay off only for costly rows. On the H200's host (16
    cores), 256 rows in JSON string states took 3.6 ms on one thread and 2.3 ms
    on four, but 256 rows in the states of a JSON object's forced punctuation
    took 0.42 ms on one thread and 0.91 ms on four (64 such rows: 0.06 against
    0.32 ms), the hand-off costing more than the rows. So a batch goes to the
    threads when one thread's time for it, estimated from the per-row time one
    thread took last, is above ``PARALLEL_US``. The estimate follows the rows'
    states: a batch the threads filled at under ``CHEAP_US`` a row (cheap rows:
    string states took 9-11 us a row there, punctuation 3.6-5) sends the next
    batch to one thread, and so does every ``PROBE``-th batch.
    """

    PARALLEL_US = 700.0
    CHEAP_US = 6.0
    PROBE = 16

    def __init__(self, threads: int) -> None:
        self.one = xgr.BatchGrammarMatcher(max_threads=1)
        self.many = xgr.BatchGrammarMatcher(max_threads=threads) if threads > 1 else None
        self.us_per_row = 2.0  # one thread's, last measured
        self.spread = 0        # batches in a row sent to the threads

    def fill(self, handles: list, bitmask: torch.Tensor, rows: list[int]) -> None:
        n = len(rows)
        start = time.perf_counter()
        if self.many is not None and self.us_per_row * n > self.PARALLEL_US and \
                self.spread < self.PROBE - 1:
            self.spread += 1
            self.many.batch_fill_next_token_bitmask(handles, bitmask, rows)
            if (time.perf_counter() - start) * 1e6 < self.CHEAP_US * n:
                self.spread = self.PROBE  # cheap rows now: measured on one thread next
            return
        self.spread = 0
        self.one.batch_fill_next_token_bitmask(handles, bitmask, rows)
        self.us_per_row = (time.perf_counter() - start) * 1e6 / max(n, 1)


_PLANS = threading.local()  # a plan per thread: the engine fills on two at once


def _fill_plan() -> _FillPlan:
    plan = getattr(_PLANS, "plan", None)
    if plan is None:
        # at most four threads: on the H200's host, eight took longer than four
        # for every batch measured (hand-off), and "auto" would take half the cores
        plan = _PLANS.plan = _FillPlan(max(1, min(4, (os.cpu_count() or 2) // 2)))
    return plan


TEXT_KEY_LIMIT = 64  # bytes of text a matcher keeps (see XGrammarMatcher)


def batch_fill(matchers: list[XGrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
    """Fill the rows of several xgrammar matchers in one call (GIL released).

    Matchers of one grammar that took the same text are in the same state: one
    of them is filled and the others' rows are copies of its row. That is the
    opening of a batch of answers to one schema, where every row is masked and
    the grammar forces the text ('{"records":[{"name":"'): the rows' tokens
    differ, their texts mostly do not (64 rows of random picks, 10 tokens in:
    49 token sequences, 11 texts). The engine reads such rows shared instead
    (:func:`fill_distinct`)."""
    fill, index = (matchers, None) if len(rows) <= 1 else _distinct_states(matchers)
    if index is None:
        _fill_states(matchers, bitmask, rows)
        return
    fill_rows = [-1] * len(fill)
    for row, at in zip(rows, index):
        if fill_rows[at] < 0:
            fill_rows[at] = row
    _fill_states(fill, bitmask, fill_rows)
    # each filled row broadcast to its copies, through numpy: no gathered
    # temporary (on the H200's host a gather of 250 rows, 1.5 MB, took as long
    # as the fills it saved), and a fifth of torch's time for the copy
    words = bitmask.numpy()
    for row, at in zip(rows, index):
        if row != fill_rows[at]:
            words[row] = words[fill_rows[at]]


def fill_distinct(matchers: list[XGrammarMatcher], bitmask: torch.Tensor) -> list[int] | None:
    """Fill one row of ``bitmask`` per state among ``matchers``, rows ``0..k-1``,
    in one call; the row that holds each matcher's mask, or None when each has
    its own (row ``i``: matcher ``i``'s).

    At a batch's opening (256 rows in a schema's forced punctuation, 1-13
    distinct texts) this fills a few rows where :func:`batch_fill` also copies
    the others (on a 2-core host 44-67 us a step against 208-266), and the
    device reads 1.5 MB less a step."""
    fill, index = _distinct_states(matchers) if len(matchers) > 1 else (matchers, None)
    _fill_states(fill, bitmask, list(range(len(fill))))
    return index


def _fill_states(matchers: list[XGrammarMatcher], bitmask: torch.Tensor, rows: list[int]
                 ) -> None:
    """Fill ``bitmask[rows[k]]`` with ``matchers[k]``'s mask: a copy of its text's
    known mask when there is one (see :class:`_TextMasks`), else xgrammar's
    fill, once the worker took the matchers' tokens; the masks xgrammar filled
    for kept texts become known. Raises when a matcher is broken (see
    :class:`_Pending`)."""
    words = bitmask.numpy() if bitmask.device.type == "cpu" else None
    if words is not None and TEXT_MASKS:
        width, left, left_rows = bitmask.shape[1], [], []
        for m, row in zip(matchers, rows):
            known = m._known_mask(width)
            if known is None:
                left.append(m)
                left_rows.append(row)
            else:
                words[row] = known
        if not left:
            return
        matchers, rows = left, left_rows
    _settle_rows(matchers)
    if _UNSETTLED.broken:
        for m in matchers:
            if m._broken is not None:
                raise RuntimeError(m._broken)
    _fill_plan().fill([m._m for m in matchers], bitmask, rows)
    if words is not None and TEXT_MASKS:
        for m, row in zip(matchers, rows):
            if m._text is not None:
                m._origin.text_masks.add(m._text, words[row])


def _distinct_states(matchers: list[XGrammarMatcher]
                     ) -> tuple[list[XGrammarMatcher], list[int] | None]:
    """The matchers to fill, one per state known shared (the same grammar and
    text), and each matcher's place among them; None when every matcher is its
    own (the matchers to fill are then ``matchers``)."""
    first: dict = {}
    texts = list(map(_TEXT, matchers))
    if None not in texts and len(set(map(_ORIGIN, matchers))) == 1:
        # (the usual batch, one grammar's matchers that all keep their texts:
        # grouped by text alone, in C-level loops)
        if _all_alike(texts):  # (rows in step: one text)
            return matchers[:1], [0] * len(texts)
        index = [first.setdefault(text, len(first)) for text in texts]
        if len(first) == len(matchers):
            return matchers, None
        return [matchers[texts.index(text)] for text in first], index
    keep: list[XGrammarMatcher] = []
    index = []
    for m in matchers:
        text = m._text
        if text is not None:
            key = (m._origin, text)
            at = first.get(key)
            if at is None:
                at = first[key] = len(keep)
                keep.append(m)
        else:
            at = len(keep)
            keep.append(m)
        index.append(at)
    if len(keep) == len(matchers):
        return matchers, None
    return keep, index
