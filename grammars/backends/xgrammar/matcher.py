"""XGrammarMatcher: one request's state in an xgrammar grammar."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy
import torch
import xgrammar as xgr

from formcast.grammars.backends.xgrammar import ffi
from formcast.grammars.backends.xgrammar.batch_accept import PreparedAccept
from formcast.grammars.backends.xgrammar.batch_fill import batch_fill, fill_distinct
from formcast.grammars.backends.xgrammar.tuning import XGrammarTuning
from formcast.grammars.backends.xgrammar.worker_jobs import backlog
from formcast.grammars.matcher import Matcher

if TYPE_CHECKING:
    from formcast.grammars.backends.xgrammar.backend import XGrammarGrammar

_DEFAULT_TUNING = XGrammarTuning()


def _refuse(token_id: int, debug: bool) -> bool:
    """The per-token accept of a matcher that took a stop token."""
    return False


def _allow_nothing(bitmask: torch.Tensor, row: int, debug: bool) -> None:
    """The per-token fill of a matcher that took a stop token (xgrammar's raises)."""
    bitmask[row] = 0


class XGrammarMatcher(Matcher):
    """A thin shell over ``xgrammar.GrammarMatcher``.

    While a matcher has taken little text it keeps that text (``_text``, up to
    the tuning's ``text_key_limit`` bytes; None after, or after a rollback or a
    stop token): the matchers of one grammar (``_origin``) that took the same
    text are in the same state, so a batch fill fills one of them and copies
    its mask to the others (see :func:`~.batch_fill.batch_fill`), or the
    engine reads its row for them (:func:`~.batch_fill.fill_distinct`).

    A matcher whose kept text has a known mask (:class:`~.text_masks.TextMasks`)
    may take a token on that mask alone, xgrammar taking it later on the
    native worker (``_pending``: the number of that job in the worker's
    backlog): every method that reads xgrammar's state waits for it first
    (:meth:`_sync`).

    A matcher made with none (``matcher`` None) forks its xgrammar matcher
    from its grammar's (``origin``) start state on first use (``_m``,
    ``_handle``, or a per-token call found None), or when the engine offers a batch's new matchers
    to :meth:`prepare` while the device runs their prefill: a batch's matchers
    are made while the device is idle, and the fork is most of their cost.
    """

    # (slots: a batch's opening reads every row's text each step, its objects cold)
    __slots__ = ("_xm", "_blocked", "_size", "_stops", "_moved", "_token_bytes", "_origin",
                 "_text", "_xfill", "_xaccept", "_xcompleted", "_xhandle", "_pending", "_broken",
                 "_recipe", "_source", "_tuning", "_view", "_masks", "_special", "_ended")

    def __init__(self, matcher: xgr.GrammarMatcher | None, blocked: frozenset[int], size: int,
                 stops: frozenset[int], *, token_bytes: tuple[bytes, ...] | None = None,
                 origin: XGrammarGrammar | None = None, text: bytes | None = b"") -> None:
        if matcher is None and getattr(origin, "_start", None) is None:
            raise ValueError("XGrammarMatcher needs an xgrammar matcher or a grammar's start "
                             "to fork")
        self._xm = self._xfill = self._xaccept = self._xcompleted = self._xhandle = None
        if matcher is not None:
            self._own(matcher)
        self._blocked = blocked
        self._size = size
        self._stops = stops  # xgrammar's stop tokens: only accepting one ends a matcher
        # the tokens accept looks at twice (blocked, stop tokens), found once a backend
        backend = None if origin is None else origin.backend
        self._special = backend.special_ids if backend is not None and \
            backend.blocked is blocked and backend.stops is stops else blocked | stops
        self._ended = False  # a stop token taken: xgrammar is offered nothing more
        self._moved = False  # a token or text was offered (see Matcher._is_fresh)
        self._token_bytes = token_bytes
        self._origin = origin
        self._tuning = _DEFAULT_TUNING if origin is None else origin.backend.tuning
        self._text = text if token_bytes is not None and origin is not None else None
        self._pending = 0     # the last backlog job taking its tokens on the worker
        self._broken = None   # why its state is not its text's (see PendingAccept)
        self._source = None   # what it forks from when not its grammar's start
        self._view = None     # (a bitmask, its numpy view) while it fills by text
        # its grammar's known masks, when it fills by text (see fill_bitmask)
        self._masks = origin.text_masks if self._text is not None and \
            self._tuning.text_masks else None

    def __del__(self, _release=ffi.release_later) -> None:  # (bound: the module may be gone)
        _release(getattr(self, "_xhandle", None))  # (xgrammar's matcher dies on the worker)

    def _own(self, matcher: xgr.GrammarMatcher) -> None:
        # (each per-token call is read once and found set, or None: fork first)
        self._xfill, self._xaccept, self._xcompleted = ffi.matcher_calls(matcher)
        self._xhandle = getattr(matcher, "_handle", None)  # (for the native batch accept)
        self._xm = matcher  # (last: a thread that sees it sees the others)

    def _fork_unlocked(self) -> None:
        if self._xm is None:
            source = self._source
            self._own((source if source is not None else self._origin._start).fork())

    def _fork(self) -> xgr.GrammarMatcher:
        """Its xgrammar matcher, forked from its grammar's start now if not yet
        (under the grammar's lock: the engine's mask thread may want it at once)."""
        with self._origin.fork_lock:
            self._fork_unlocked()
        return self._xm

    @staticmethod
    def prepare(matchers: list[XGrammarMatcher]) -> None:
        """Fork the xgrammar matchers of those of ``matchers`` that have none yet
        (the engine's optional hook, offered a step's new constraints while the
        device runs their prefill)."""
        for m in matchers:
            if m._xm is None:
                with m._origin.fork_lock:
                    m._fork_unlocked()

    @property
    def _m(self) -> xgr.GrammarMatcher:
        m = self._xm
        return m if m is not None else self._fork()

    @property
    def _handle(self):
        if self._xm is None:
            self._fork()
        return self._xhandle

    def _sync(self) -> None:
        """Wait until xgrammar took the tokens this matcher took on known masks;
        raises when one broke it (see :class:`~.worker_jobs.PendingAccept`).
        Callers on the per-token path call it only when ``_pending`` is set: a
        matcher is broken only by a job of its own."""
        if self._pending:
            pending = backlog()
            if self._pending > pending.settled:
                pending.settle(self._pending)
        if self._broken is not None:
            raise RuntimeError(self._broken)

    def _known_mask(self, width: int) -> numpy.ndarray | None:
        """Its kept text's known mask (an int32 row ``width`` words wide, see
        :class:`~.text_masks.TextMasks`), or None."""
        text = self._text
        if text is None or self._broken is not None or not self._tuning.text_masks:
            return None
        masks = self._origin.text_masks
        at = masks.row(text, width)
        return None if at is None else masks.rows[at]

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        text, masks = self._text, self._masks
        if text is not None and masks is not None:
            # (fill by text, inline: most of a short answer's tokens come here)
            view = self._view  # (torch's own row copy and numpy view cost more than a fill)
            if view is None or view[0] is not bitmask:
                view = self._view = self._origin.backend.numpy_view(bitmask)
            words = view[1]
            if words is None:  # (not in host memory: xgrammar refuses it)
                self._fill_device(bitmask, row)
                return
            if self._broken is None:
                at = masks.slots.get(text)
                if at is not None and words.shape[1] == masks.words:  # (_known_mask)
                    words[row] = masks.rows[at]
                    return
            if self._pending:
                self._sync()
            fill = self._xfill
            if fill is None:
                self._fork()
                fill = self._xfill
            fill(bitmask, row, False)
            # (a text's mask is kept on its second visit: most are visited once)
            if masks.seen_before(text):
                masks.add(text, words[row])
            return
        if self._pending:
            self._sync()
        fill = self._xfill
        if fill is None:
            self._fork()
            fill = self._xfill
        fill(bitmask, row, False)

    def _fill_device(self, bitmask: torch.Tensor, row: int) -> None:
        """:meth:`fill_bitmask` into a mask outside host memory, which xgrammar
        refuses: a copy of its text's known mask (else xgrammar's error)."""
        known = self._known_mask(bitmask.shape[1])
        if known is not None:
            bitmask[row] = torch.from_numpy(known)
            return
        if self._pending:
            self._sync()
        fill = self._xfill
        if fill is None:
            self._fork()
            fill = self._xfill
        fill(bitmask, row, False)

    @staticmethod
    def tidy() -> None:
        """Housekeeping the engine offers while it waits for the device (its
        optional hook): the jobs the native worker is through with are checked
        and let go, so that a finished batch's matchers, when those held their
        last references, are destroyed here rather than on the engine's path."""
        pending = backlog()
        if pending is not None and pending.queue:
            pending.settle(done_only=True)

    @staticmethod
    def fill_bitmasks(matchers: list[XGrammarMatcher], bitmask: torch.Tensor,
                      rows: list[int]) -> None:
        """Several matchers' rows in one call (the engine's optional batch hook)."""
        batch_fill(matchers, bitmask, rows)

    @staticmethod
    def fill_distinct_bitmasks(matchers: list[XGrammarMatcher], bitmask: torch.Tensor
                               ) -> list[int] | None:
        """One mask row per distinct state, rows ``0..k-1``, and the row of each
        matcher (the engine's optional batch hook; see :func:`~.batch_fill.fill_distinct`)."""
        return fill_distinct(matchers, bitmask)

    @staticmethod
    def accept_tokens(matchers: list[XGrammarMatcher], tokens: list[int]) -> list[int]:
        """Advance each matcher by its token, the xgrammar part in one native call
        (the engine's optional batch hook). Per row: 0 refused (state unchanged),
        1 taken, 2 taken and now terminated."""
        return PreparedAccept(matchers)(tokens)

    @staticmethod
    def batch_acceptor(matchers: list[XGrammarMatcher]) -> PreparedAccept:
        """:meth:`accept_tokens` for these matchers, prepared once for as many
        steps as they run together (the engine's optional batch hook)."""
        return PreparedAccept(matchers)

    def _is_fresh(self) -> bool:
        return not self._moved

    def _may_offer(self, token_id: int) -> bool:
        """Whether ``token_id`` may go to xgrammar at all (not a blocked special
        token, inside the tokenizer's ids, and the matcher not ended)."""
        return token_id not in self._blocked and 0 <= token_id < self._size and not self._ended

    def accept(self, token_id: int) -> bool:
        if token_id in self._special or not 0 <= token_id < self._size:
            return self._accept_special(token_id)
        self._moved = True
        if self._pending:
            self._sync()
        accept = self._xaccept
        if accept is None:
            self._fork()
            accept = self._xaccept
        if not accept(token_id, False):
            return False
        text = self._text
        if text is not None:  # (_took, inline: most of an answer's opening keeps its text)
            text += self._token_bytes[token_id]
            self._text = text if len(text) <= self._tuning.text_key_limit else None
        return True

    def _accept_special(self, token_id: int) -> bool:
        """:meth:`accept` of a blocked token, an id out of range, or a stop token
        (which ends the matcher: xgrammar, which logs each token offered after
        its end on stderr, is then offered none, see :meth:`_end`)."""
        if token_id in self._blocked or not 0 <= token_id < self._size or self._ended:
            return False
        self._moved = True
        self._sync()
        if not self._m.accept_token(token_id):
            return False
        self._end()
        return True

    def _end(self) -> None:
        """A stop token was taken: every later token is refused here, and no
        token is allowed (until a rollback), without a call to xgrammar."""
        self._ended = True
        self._text = None
        self._xaccept, self._xfill = _refuse, _allow_nothing

    def _unend(self) -> None:
        """A rollback took the stop token back."""
        self._ended = False
        self._own(self._xm)

    def accept_text(self, text: str) -> bool:
        if self._ended:
            return False
        self._moved = True
        self._sync()
        taken = self._m.accept_string(text)
        if self._text is not None:
            self._grow_text(text.encode("utf-8") if taken else None)
        return taken

    def _took(self, token_id: int) -> None:
        """Keep the text of a token just taken (a stop token: a state of its own)."""
        if token_id in self._stops:
            self._text = None
        else:
            grown = self._text + self._token_bytes[token_id]
            self._text = grown if len(grown) <= self._tuning.text_key_limit else None

    def _grow_text(self, data: bytes | None) -> None:
        """The kept text with ``data`` after it, while short; None: no longer kept."""
        grown = None if data is None else self._text + data
        self._text = grown if grown is not None and \
            len(grown) <= self._tuning.text_key_limit else None

    def rollback(self, num_tokens: int) -> None:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if num_tokens:
            self._sync()
            self._text = None  # (the text before is not kept)
            self._restart_spans()
            try:
                self._m.rollback(num_tokens)
            except RuntimeError as exc:
                raise ValueError(ffi.library_message(exc)) from None
            if self._ended:
                self._unend()

    def is_terminated(self) -> bool:
        self._sync()
        return self._m.is_terminated()

    def is_completed(self) -> bool:
        if self._pending:
            self._sync()
        completed = self._xcompleted
        if completed is None:
            self._fork()
            completed = self._xcompleted
        return completed()

    def forced_tokens(self) -> list[int]:
        self._sync()
        return self._m.find_jump_forward_tokens()

    def take_forced_tokens(self, limit: int) -> list[int]:
        """A new matcher not forked yet takes the tokens its grammar fixes at
        its start by pointing its fork at a matcher that took them (see
        :meth:`XGrammarGrammar.opening`): no xgrammar call for a batch's
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
        there is often refused. Matchers of one grammar that took the same kept
        text share the answer, found once."""
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
            if len(known) >= self._tuning.text_answers_kept:
                known.clear()
            got = known[text] = answer()
        return got

    def fork(self) -> XGrammarMatcher:
        matcher = None  # (still at its grammar's start, never forked: the copy forks when used)
        if self._xm is not None:
            self._sync()
            matcher = self._xm.fork()
        copy = XGrammarMatcher(matcher, self._blocked, self._size, self._stops,
                               token_bytes=self._token_bytes, origin=self._origin,
                               text=self._text)
        if self._ended:
            copy._end()
        return copy

    @property
    def xgrammar_matcher(self) -> xgr.GrammarMatcher:
        """The wrapped xgrammar matcher (for batch filling), in step with its text."""
        self._sync()
        return self._m

    @property
    def kept_text(self) -> bytes | None:
        """The text it took while that is short (see the class); None once not kept."""
        return self._text

    @property
    def forked(self) -> bool:
        """Whether its xgrammar matcher is made yet (it forks on first use or in :meth:`prepare`)."""
        return self._xm is not None
