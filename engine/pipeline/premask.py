"""Premasking: masking a greedy constrained row for its next pick where its
model keeps breaking the grammar, before the pick is refused.

A greedy constrained row picks unmasked until its grammar refuses a pick; the
refused row is sampled again under its mask and set back a step (the step
launched on the refused token is lost to it), and a batch whose rows were set
back ends a step or more after the rest. Where a model breaks the grammar, it
breaks it at the same places: a model of random weights (the GPU benchmark's)
writes words inside a span of free text, and its pick after the span's closing
token, where the grammar wants punctuation, is refused nearly every time. So
once the picks after such a token (one the constraint says closes a span,
:meth:`BaseConstraint.closes_span`) mostly broke the grammar, a row that takes
one is masked for its next pick, until its model agrees with its grammar again:
no pick refused, no step lost, the same tokens (greedy under the mask either
way). Whether the model would have broken it is still seen: a premasked row's
masked pick is watched, and one that is not the model's argmax would have been
refused. A model that follows the grammar there (a trained one) never turns it
on. (Tokens that open a span count out: the word after one goes right, and
counted in they would hold the average down.)

The engine knows no language here: which tokens may close a span, and whether
one does given the output before it, are the constraint's answers
(``span_closing_tokens``, ``closes_span``; ``formcast.grammars`` answers them
for JSON strings).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable

from formcast.engine.constraint import ops_for
from formcast.engine.pipeline.state import PipelineStats, Taking
from formcast.engine.sequence import Sequence, SequenceStatus
from formcast.engine.tokenizer import Tokenizer
from formcast.engine.tuning import EngineTuning

FINISHED = SequenceStatus.FINISHED
CONSTRAINT = operator.attrgetter("constraint")


class Premasker:
    """Which rows premasking masks, and whether it is on (a moving average of
    how often the model's pick after a span-closing token broke the grammar)."""

    def __init__(self, tokenizer: Tokenizer, tuning: EngineTuning, stats: PipelineStats) -> None:
        self.tokenizer = tokenizer
        self.tuning = tuning
        self.stats = stats
        # constraint class -> its span-closing tokens, and its closes_span: asked once
        self._closers_of: dict[type, frozenset[int]] = {}
        self._closes: dict[type, Callable[..., bool]] = {}
        self._rows: list[Sequence] = []  # the rows _closers is for
        self._seen: list[Sequence] | None = None  # the list last asked about (not copied)
        self._closers: frozenset[int] = frozenset()
        self.rate = 0.0  # the moving average
        self.premasked: dict[Sequence, None] = {}  # rows whose first masked pick is due
        self.risky_after: list[Sequence] = []  # rows whose next pick's verdict is due
        self.wait = None  # the accept a premasked row's mask waits for

    def closers_for(self, seqs: list[Sequence]) -> frozenset[int]:
        """The tokens after which premasking may mask one of ``seqs``: those
        their constraints' classes say may close a span, found again only when
        the rows change."""
        if seqs is self._seen:  # (a step asks for its rows' list several times)
            return self._closers
        if seqs != self._rows:  # (identity compares, in C)
            self._rows = list(seqs)
            found: frozenset[int] = frozenset()
            for kind in set(map(type, map(CONSTRAINT, seqs))):
                closers = self._closers_of.get(kind)
                if closers is None:
                    closers = self._learn(kind)
                found = found | closers if found else closers
            self._closers = found
        self._seen = seqs
        return self._closers

    def _learn(self, kind: type) -> frozenset[int]:
        """Ask constraint class ``kind`` for its span-closing tokens (given)
        and its ``closes_span``."""
        ops = ops_for(kind)
        try:
            closers = None if ops.span_closing_tokens is None else \
                ops.span_closing_tokens(self.tokenizer.token_bytes())
        except Exception:  # (a heuristic's failure fails no request: no spans)
            closers = None
        self._closes[kind] = ops.closes_span
        closers = self._closers_of[kind] = frozenset(closers or ())
        return closers

    def closes_span(self, seq: Sequence, token: int, appended: bool) -> bool:
        """Whether ``token`` (one of :meth:`closers_for`'s, the last of ``seq``'s
        output if ``appended``) closes a span of ``seq``'s constraint, where its
        grammar wants punctuation next, rather than opening one, where any word
        goes (the picks a model of random weights gets wrong, and right)."""
        constraint, ids = seq.constraint, seq.token_ids
        closes = self._closes.get(type(constraint))
        if closes is None:
            self._learn(type(constraint))
            closes = self._closes[type(constraint)]
        try:
            return closes(constraint, ids, seq.num_prompt_tokens, len(ids) - appended, token)
        except Exception:  # (as in _learn)
            return False

    def pick_closes_span(self, seqs: list[Sequence], seq: Sequence, token: int) -> bool:
        """Whether ``token``, the pick of ``seq`` (one of ``seqs``) not yet
        appended, closes a span (:meth:`closes_span`). A masked row's agreement
        on such a pick does not end its masking (:meth:`Taker.begin`): the next
        pick is the grammar's punctuation, which the agreement says nothing about."""
        return token in self.closers_for(seqs) and self.closes_span(seq, token, False)

    def active(self) -> bool:
        """Whether premasking is on."""
        return self.rate >= self.tuning.premask_after

    def premask(self, seq: Sequence) -> None:
        """Mask ``seq`` for its next pick, and watch that pick."""
        seq.premask()
        self.premasked[seq] = None
        self.stats.num_premasked_picks += 1

    def landed(self, taking: Taking) -> None:
        """Premask the rows of ``taking`` whose unmasked pick, landed and being
        checked on the accept thread or the native worker, closes a span,
        for the sampling that comes before the verdicts: their masks (filled by
        :meth:`RowSampler.masks_for`) wait for that check, which their matchers' state
        follows. A pick that turns out refused sets its row back as ever."""
        if not taking.checked or not self.active():
            return
        seqs, tokens = taking.prev.seqs, taking.token_list
        risky = self.closers_for(seqs)
        if risky.isdisjoint(tokens):
            return
        found = False
        for i in taking.checked:
            if tokens[i] in risky and not seqs[i].masked and \
                    self.closes_span(seqs[i], tokens[i], False):
                self.premask(seqs[i])
                found = True
        if found:
            self.wait = taking.pending

    def watch(self, taking: Taking, rows: list[Sequence], tokens: list[int],
                     refused: list[int]) -> None:
        """After a take's verdicts (``rows`` took ``tokens`` unmasked; the picks at
        ``refused`` were refused): the verdicts on the rows that closed a span
        the step before count in :attr:`rate`, and the rows that
        take one now are premasked (when premasking and the step's sampling
        comes after this) or watched so."""
        after = self.risky_after
        if after:  # (a few rows: each looked up in C)
            self.risky_after = []
            missed = [taking.prev.seqs[i] for i in refused]
            for seq in after:
                if seq in missed:
                    self.seen(True)
                elif seq in rows:
                    self.seen(False)
        risky = self.closers_for(taking.prev.seqs)
        if risky.isdisjoint(tokens):
            return
        premask = self.active() and not taking.sampled
        # (the rows that took one, found in C: a trained model takes one at most
        # steps of a large batch)
        for seq, token in itertools.compress(zip(rows, tokens), map(risky.__contains__, tokens)):
            if not seq.masked and seq.status is not FINISHED and \
                    self.closes_span(seq, token, True):
                if premask:
                    self.premask(seq)
                else:
                    self.risky_after.append(seq)

    def forget(self) -> None:
        """Drop the rows premasked or watched and the check a mask waits for (the
        pipeline is over; the moving average stays)."""
        self.premasked.clear()
        self.risky_after, self.wait = [], None
        self._rows, self._seen, self._closers = [], None, frozenset()

    def seen(self, missed: bool) -> None:
        """A pick after a span-closing token broke the grammar (``missed``), or did not."""
        self.rate += (float(missed) - self.rate) * self.tuning.premask_ema
