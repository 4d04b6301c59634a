"""Premasking: masking a greedy constrained row for its next pick where its
model keeps breaking the grammar, before the pick is refused.

A greedy constrained row picks unmasked until its grammar refuses a pick; the
refused row is sampled again under its mask and set back a step (the step
launched on the refused token is lost to it), and a batch whose rows were set
back ends a step or more after the rest. Where a model breaks the grammar, it
breaks it at the same places: a model of random weights (the GPU benchmark's)
writes words inside a JSON string, and its pick after the string's closing
quote, where the grammar wants punctuation, is refused nearly every time. So
once the picks after such a token (one holding a double quote that leaves the
output out of a string, :meth:`Premasker.leaves_string`) mostly broke the grammar, a row
that takes one is masked for its next pick, until its model agrees with its
grammar again: no pick refused, no step lost, the same tokens (greedy under the
mask either way). Whether the model would have broken it is still seen: a
premasked row's masked pick is watched, and one that is not the model's argmax
would have been refused. A model that follows the grammar there (a trained one
writing JSON) never turns it on. (Quotes that open a string count out: the word
after one goes right, and counted in they would hold the average down.)
"""

from __future__ import annotations

import itertools

from formcast.engine.pipeline.state import PipelineStats, Taking
from formcast.engine.sequence import Sequence, SequenceStatus
from formcast.engine.tokenizer import Tokenizer
from formcast.engine.tuning import EngineTuning

FINISHED = SequenceStatus.FINISHED


class Premasker:
    """Which rows premasking masks, and whether it is on (a moving average of
    how often the model's pick after a risky token broke the grammar)."""

    def __init__(self, tokenizer: Tokenizer, tuning: EngineTuning, stats: PipelineStats) -> None:
        self.tokenizer = tokenizer
        self.tuning = tuning
        self.stats = stats
        self._risky: frozenset[int] | None = None  # tokens that may end a JSON string
        self._quotes: list[int] | None = None  # each token's unescaped double quotes
        self.rate = 0.0  # the moving average
        self.premasked: dict[Sequence, None] = {}  # rows whose first masked pick is due
        self.risky_after: list[Sequence] = []  # rows whose next pick's verdict is due
        self.wait = None  # the accept a premasked row's mask waits for


    def risky_tokens(self) -> frozenset[int]:
        """The tokens after which premasking may mask a row: those whose text
        holds a double quote (one that leaves a JSON string, :meth:`_leaves_string`)."""
        risky = self._risky
        if risky is None:
            quotes = self._quotes = [b.count(b'"') - b.count(b'\\"')
                                     for b in self.tokenizer.token_bytes()]
            risky = self._risky = frozenset(i for i, n in enumerate(quotes) if n)
        return risky

    def leaves_string(self, seq: Sequence, token: int, appended: bool) -> bool:
        """Whether ``token`` (a risky one, the last of ``seq``'s output if
        ``appended``) leaves the row's output with an even number of unescaped
        double quotes: in JSON, out of a string (a key's end, a value's), where
        its grammar wants punctuation next, rather than into one, where any
        word goes (the picks a model of random weights gets wrong, and right).
        The count goes on from where the last call stopped (a few list lookups
        a token, in C), from the output's start again after a rollback (which
        resets it; a shorter output than counted does too)."""
        ids, quotes = seq.token_ids, self._quotes
        upto = len(ids) - appended
        done, parity = seq.quote_scan
        if upto < done:  # (tokens taken back)
            done, parity = seq.num_prompt_tokens, 0
        if upto > done:
            parity ^= sum(map(quotes.__getitem__, ids[done:upto])) & 1
            seq.quote_scan = (upto, parity)
        return not (parity + quotes[token]) & 1

    def ends_string(self, seq: Sequence, token: int) -> bool:
        """Whether ``token``, ``seq``'s pick not yet appended, leaves its output
        out of a JSON string (:meth:`leaves_string`, for a risky token). A
        masked row's agreement on such a pick does not end its masking
        (:meth:`Taker.begin`): the next pick is the schema's punctuation, which
        the agreement says nothing about."""
        return token in self.risky_tokens() and self.leaves_string(seq, token, False)

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
        checked on the accept thread or the native worker, is a risky token,
        for the sampling that comes before the verdicts: their masks (filled by
        :meth:`RowSampler.masks_for`) wait for that check, which their matchers' state
        follows. A pick that turns out refused sets its row back as ever."""
        if not taking.checked or not self.active():
            return
        tokens, risky = taking.token_list, self.risky_tokens()
        if risky.isdisjoint(tokens):
            return
        seqs, found = taking.prev.seqs, False
        for i in taking.checked:
            if tokens[i] in risky and not seqs[i].masked and \
                    self.leaves_string(seqs[i], tokens[i], False):
                self.premask(seqs[i])
                found = True
        if found:
            self.wait = taking.pending

    def watch(self, taking: Taking, rows: list[Sequence], tokens: list[int],
                     refused: list[int]) -> None:
        """After a take's verdicts (``rows`` took ``tokens`` unmasked; the picks at
        ``refused`` were refused): the verdicts on the rows that took a risky
        token the step before count in :attr:`rate`, and the rows that
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
        risky = self.risky_tokens()
        if risky.isdisjoint(tokens):
            return
        premask = self.active() and not taking.sampled
        # (the rows that took one, found in C: a trained model writing JSON takes
        # quotes at most steps of a large batch)
        for seq, token in itertools.compress(zip(rows, tokens), map(risky.__contains__, tokens)):
            if not seq.masked and seq.status is not FINISHED and \
                    self.leaves_string(seq, token, True):
                if premask:
                    self.premask(seq)
                else:
                    self.risky_after.append(seq)

    def forget(self) -> None:
        """Drop the rows premasked or watched and the check a mask waits for (the
        pipeline is over; the moving average stays)."""
        self.premasked.clear()
        self.risky_after, self.wait = [], None

    def seen(self, missed: bool) -> None:
        """A pick after a risky token broke the grammar (``missed``), or did not."""
        self.rate += (float(missed) - self.rate) * self.tuning.premask_ema
