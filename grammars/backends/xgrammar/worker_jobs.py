"""The jobs the xgrammar backend gives the native worker: a step's accept as
its tokens land (:class:`NativeAccept`), and the tokens matchers took on their
texts' known masks, for xgrammar to take too (:class:`PendingAccept`)."""

from __future__ import annotations

import array
import ctypes
from functools import cache
from typing import TYPE_CHECKING, Any

import torch

from formcast.grammars.backends.xgrammar import ffi, native

if TYPE_CHECKING:
    from formcast.grammars.backends.xgrammar.batch_accept import PreparedAccept
    from formcast.grammars.backends.xgrammar.matcher import XGrammarMatcher


class NativeAccept:
    """A :class:`~.batch_accept.PreparedAccept` of one step's tokens on the
    native worker (:meth:`PreparedAccept.launch`): ``result()`` is the verdicts,
    as the prepared accept's call gives them, or None when a column's dead-end
    flag is set (no matcher moved); ``done()`` whether the worker is through."""

    __slots__ = ("part", "worker", "host", "cols", "job", "_keep", "_outcome")

    def __init__(self, part: PreparedAccept, worker: native.Worker, host: torch.Tensor,
                 cols: list[int], query: tuple[int, int, int] | None) -> None:
        self.part, self.worker, self.host, self.cols = part, worker, host, cols
        n = len(cols)
        col_array = part.col_array(cols)
        verdicts = (ctypes.c_int8 * n)()
        special = part.special_bits()
        job = self.job = native.Job(
            fn=ffi.BATCH_ACCEPT.__chandle__(), handles=part.handles.__chandle__(),
            host=host.data_ptr(), stride=host.size(1), cols=ctypes.addressof(col_array), n=n,
            vocab=part.size, special=ctypes.addressof(special),
            verdicts=ctypes.addressof(verdicts))
        if query is not None:
            job.query, job.query_arg, job.not_ready = query
            job.poll_pauses = part.tuning.poll_pauses
        # (what the worker reads, alive until it is done)
        self._keep = (col_array, verdicts, special, part.handles)
        self._outcome: tuple[list[int] | None] | None = None
        worker.submit(job)

    def done(self) -> bool:
        """Whether the worker is through with it (no wait)."""
        return self.job.state != native.QUEUED

    def wait(self) -> None:
        """Until the worker is through with the matchers (no result read)."""
        self.worker.wait(self.job)

    def result(self) -> list[int] | None:
        """The verdicts (waiting for the worker), or None when a dead-end flag was set."""
        if self._outcome is None:
            self._outcome = self._finish(self.worker.wait(self.job))
        return self._outcome[0]

    def _finish(self, state: int) -> tuple[list[int] | None]:
        if state == native.DEAD:
            return (None,)
        if state == native.ERROR:
            raise RuntimeError(ffi.library_message(RuntimeError(
                self.job.error.decode("utf-8", "replace"))))
        part = self.part
        tokens = None
        if state == native.SLOW or part.texts:
            row = self.host[0].tolist()
            tokens = [row[c] for c in self.cols]
        if state == native.SLOW:  # (no matcher moved: the ordinary way)
            return (part(tokens),)
        verdicts = list(bytes(self._keep[1]))
        if part.texts:
            part.keep_texts(tokens, verdicts)
        return (verdicts,)


class PendingAccept:
    """Tokens that matchers took on their texts' known masks, being offered to
    xgrammar on the native worker (one entry of the worker's
    :class:`~.native.Backlog`). The matchers are in step with their texts once
    it is checked; a token xgrammar refuses there (its mask allowed it: never
    seen) breaks its matcher, which raises from then on, so its request fails
    with the reason rather than going on from a state that is not its text's."""

    __slots__ = ("seq", "job", "worker", "matchers", "tokens", "_keep")

    def __init__(self, seq: int, worker: native.Worker, handles: Any,
                 matchers: list[XGrammarMatcher], tokens: array.array) -> None:
        n = len(matchers)
        self.seq, self.worker, self.matchers, self.tokens = seq, worker, matchers, tokens
        host = tokens  # (the worker reads [2, n]: the tokens, then the dead-end flags)
        cols = identity_cols(n)
        verdicts = bytearray(n)
        job = self.job = native.Job()
        job.fn, job.handles = ffi.BATCH_ACCEPT.__chandle__(), handles.__chandle__()
        job.host, job.stride, job.n = host.buffer_info()[0], n, n
        job.cols, job.vocab = ctypes.addressof(cols), 1 << 62
        keep = (ctypes.c_int8 * n).from_buffer(verdicts)
        job.verdicts = ctypes.addressof(keep)
        self._keep = (host, cols, verdicts, keep, handles)  # (what the worker reads)
        worker.submit(job)

    def __del__(self, _release=ffi.release_later) -> None:  # (bound: the module may be gone)
        keep = getattr(self, "_keep", None)  # (none when the submit failed first)
        _release(keep[4] if keep else None)  # (the handles, maybe the last reference)

    def finish(self) -> int:
        """Wait for the worker, then break the matchers whose token it refused:
        how many it broke."""
        state = self.worker.wait(self.job)
        if state == native.DONE:
            verdicts = bytes(self._keep[2])
            if verdicts.count(1) == len(verdicts):
                return 0
            broken = 0
            for m, t, v in zip(self.matchers, self.tokens, verdicts):
                if not v:
                    m._broken = (f"xgrammar refused token {t} after its mask for the text "
                                 "before allowed it")
                    broken += 1
            return broken
        reason = self.job.error.decode("utf-8", "replace") if state == native.ERROR \
            else f"the native worker answered state {state}"
        why = ffi.library_message(RuntimeError(reason))
        for m in self.matchers:
            m._broken = f"taking a token on the native worker failed: {why}"
        return len(self.matchers)


@cache
def identity_cols(n: int) -> ctypes.Array:
    """``0..n-1`` as int32 for the worker (the same for every batch of ``n`` rows)."""
    return (ctypes.c_int32 * n)(*range(n))


def backlog() -> native.Backlog | None:
    """The started worker's backlog of :class:`PendingAccept` jobs, or None."""
    worker = native.started()
    return None if worker is None else worker.backlog


def settle_rows(matchers: list[XGrammarMatcher]) -> None:
    """Wait until xgrammar took the tokens that any of ``matchers`` took on
    known masks (their states then read as their texts')."""
    pending = backlog()
    if pending is not None and pending.last != pending.settled:
        through = max(m._pending for m in matchers)
        if through > pending.settled:
            pending.settle(through)


def any_broken(matchers: list[XGrammarMatcher]) -> bool:
    """Whether a check on the worker broke any of ``matchers``."""
    pending = backlog()
    return pending is not None and pending.failures > 0 and \
        any(m._broken is not None for m in matchers)
