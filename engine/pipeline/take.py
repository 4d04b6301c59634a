"""Taking a step in flight: its tokens, landed on the host, go to their requests.

The rows sampled on the device (no constraint, or under their masks) take their
tokens first, their next masks then filling on the mask thread; the unmasked
greedy picks are offered to their constraints (on the accept thread or the
native worker since they landed, or here); a refused pick's row is sampled
again under its mask, by the caller when it defers that.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

from formcast.engine.chores import HostChores
from formcast.engine.constraint_ops import Acceptor, accept_batch, narrow_choice, rows_of
from formcast.engine.kernels import wait_event
from formcast.engine.output import OutputProcessor
from formcast.engine.pipeline.premask import Premasker
from formcast.engine.pipeline.sampling import RowSampler
from formcast.engine.pipeline.state import (InFlight, PipelineStats, Room, Taking, wait_landed,
                                            without)
from formcast.engine.sampler import Sampler
from formcast.engine.sequence import Sequence, SequenceStatus
from formcast.engine.tuning import EngineTuning

FINISHED = SequenceStatus.FINISHED
STREAK = operator.attrgetter("refusal_streak")


class Taker:
    """Takes steps in flight (:meth:`take`, or :meth:`begin` then :meth:`end`
    around work that overlaps the picks' check).

    Parameters
    ----------
    output : OutputProcessor
        Appends the tokens taken.
    chores : HostChores
        Done while the host waits for a step's tokens.
    premasker : Premasker
        Sees the verdicts on the picks after span-closing tokens.
    rows : RowSampler
        Samples refused rows again; its mask thread fills the next masks.
    room_of : Callable[[list[Sequence]], Room]
        What the pipeline knows of its rows' room.
    eos_token_ids : frozenset[int]
        The tokens that end a request.
    tuning : EngineTuning
        The engine's knobs.
    stats : PipelineStats
        Counts picks taken and refused.
    """

    def __init__(self, output: OutputProcessor, chores: HostChores, premasker: Premasker,
                 rows: RowSampler, room_of: Callable[[list[Sequence]], Room], *,
                 eos_token_ids: frozenset[int], tuning: EngineTuning,
                 stats: PipelineStats) -> None:
        self.output = output
        self.chores = chores
        self.premasker = premasker
        self.rows = rows
        self.room_of = room_of
        self.eos_token_ids = eos_token_ids
        self.tuning = tuning
        self.stats = stats
        self.masked_acceptor = Acceptor()  # (rows sampled under their masks)

    def take(self, prev: InFlight, *, defer: bool = False
             ) -> tuple[list[Sequence], set[Sequence], list[int]]:
        """Append a launched step's tokens to its requests (waiting for the copy).

        Returns the requests that took a token or ended (the step's outputs), those
        of them that took their token, and the rows (indices into ``prev.seqs``)
        whose unmasked greedy pick their constraint refused. Those rows are
        sampled again under their masks by the caller when ``defer``, else here
        (waiting for the device), and then count among the outputs."""
        return self.end(self.begin(prev, defer=defer))

    def begin(self, prev: InFlight, *, defer: bool = False) -> Taking:
        """:meth:`take`'s first half: the rows sampled on the device (no
        constraint, or under their masks) take their tokens and the next masks of
        those that stay masked start filling on the mask thread. The unmasked
        picks are offered to their constraints by :meth:`end`, unless the
        accept thread has been at it since they landed (``prev.early``)."""
        lists = None
        if prev.landed is not None:
            # the accept thread reads the tokens first (and this thread sleeps
            # meanwhile): it then holds the interpreter lock only until its native
            # accept starts, rather than waiting for it behind this thread's work
            wait_landed(prev)
            lists = prev.lists
        if lists is None:
            if prev.ready is not None:
                if not prev.ready.query():  # (the device is busy: the host's chores now)
                    def busy(ready=prev.ready) -> bool:
                        return not ready.query()

                    self.chores.while_busy(prev.seqs, busy)
                wait_event(prev.ready)
            lists = prev.host.tolist()
        token_list, dead_list = lists
        errors: dict[int, str] = {}
        if any(dead_list):
            token_list = Sampler.finish_rows(token_list, dead_list, errors)
        seqs = prev.seqs
        if prev.watched:
            premasker = self.premasker
            premasked = premasker.premasked
            agrees = prev.agree.tolist()
            if not premasked and not any(agrees):  # (a batch's opening: none met its argmax)
                Sequence.masked_picks_missed(map(seqs.__getitem__, prev.watched))
                agrees = ()
            for i, agreed in zip(prev.watched, agrees):
                seq = seqs[i]
                if premasked and seq in premasked:  # (its first masked pick since premasked)
                    del premasked[seq]
                    premasker.seen(not agreed)
                if agreed and seq.masked and seq.agreements_due <= 1 and (
                        narrow_choice(seq) or
                        premasker.pick_closes_span(seqs, seq, token_list[i])):
                    # (the grammar left few tokens there, or fixed the text: an
                    # agreement shows little, and the next pick, unmasked, would be
                    # a gamble; or the pick closes a span, and the next one is the
                    # grammar's punctuation, which the agreement says nothing about)
                    continue
                seq.masked_pick_seen(agreed)
        free, masked, checked = prev.free, prev.masked, list(prev.unchecked)
        room = self.room_of(seqs)
        taking = Taking(prev=prev, token_list=token_list, checked=checked, defer=defer,
                         quiet=room.quiet and room.tokens > 2 and
                         self.eos_token_ids.isdisjoint(token_list))
        outputs = taking.outputs
        if errors or prev.void or self.output.num_finishes != prev.finishes:
            taking.clean = False
            # rows that failed to sample, and requests ended meanwhile (aborted: their
            # output went out then), take nothing
            gone = {i for i, seq in enumerate(seqs) if seq.status is FINISHED} | prev.void
            for i in sorted(errors.keys() - gone):
                outputs.append(seqs[i])
                self.output.settle(seqs[i], token_list[i], None, errors[i])
            gone.update(errors)
            free, masked, checked = ([i for i in rows if i not in gone]
                                     for rows in (free, masked, checked))
            taking.checked = checked
        if prev.early is not None:  # (checked since the tokens landed, or being checked)
            taking.pending, taking.pending_rows = prev.early, list(prev.unchecked)
        ok, rows_sampler = taking.ok, self.rows
        try:
            # sampled rows (masked, free) first: the next masks of those that stay
            # masked are then filled on the mask thread while the unmasked picks
            # are checked, both in native code
            if free:
                rows, tokens = rows_of(seqs, token_list, free)
                self.output.append_taken(rows, tokens, quiet=taking.quiet)
                outputs += rows
                ok.update(rows)
            if masked:  # sampled under their masks: their constraints take them in one go
                rows, tokens = rows_of(seqs, token_list, masked)
                # (prepared once for the batch's rows, its part for the masked rows
                # made again only when they change). Here, on this thread: taking
                # them on the accept thread as they land measured no better
                verdicts = self.masked_acceptor(seqs, token_list, masked)
                if verdicts.count(1) == len(verdicts):  # (the usual step)
                    self.output.append_taken(rows, tokens, quiet=taking.quiet)
                    ok.update(rows)
                else:
                    for seq, token, verdict in zip(rows, tokens, verdicts):
                        if verdict <= 0:  # a token its own mask allowed, or the constraint failed
                            seq.error = seq.error or f"constraint rejected sampled token {token}"
                            self.output.finish(seq, "abort")
                    self.output.append_taken(rows, tokens, verdicts)
                    ok.update(seq for seq, verdict in zip(rows, verdicts) if verdict > 0)
                outputs += rows
            if defer and checked and masked:  # (the rows the next sampling draws, as it lists them)
                nxt = [seqs[i] for i in (sorted(free + masked) if free else masked)]
                nxt = [s for s in nxt if s in ok and s.status is not FINISHED
                       and not rows_sampler.picks_unmasked(s)]
                if len(nxt) >= self.tuning.async_fill_rows and any(s.constraint is not None for s in nxt):
                    taking.ahead = rows_sampler.masks_ahead = nxt, rows_sampler.masks.submit(nxt)
        except BaseException:
            taking.abandon()
            raise
        return taking

    def end(self, taking: Taking) -> tuple[list[Sequence], set[Sequence], list[int]]:
        """:meth:`take`'s second half: the unmasked picks' verdicts (waited for
        when on the accept thread) and what follows from them; returns as :meth:`take`."""
        prev, outputs, ok, checked = taking.prev, taking.outputs, taking.ok, taking.checked
        seqs = prev.seqs
        refused: list[int] = []
        try:
            if checked:  # unmasked greedy picks, offered to their constraints now
                rows, tokens = rows_of(seqs, taking.token_list, checked)
                pending, taking.pending = taking.pending, None
                verdicts = pending.result() if pending is not None else None
                if verdicts is None:
                    verdicts = accept_batch(rows, tokens)
                elif len(taking.pending_rows) != len(checked):  # (rows gone since: skipped)
                    at = dict(zip(taking.pending_rows, verdicts))
                    verdicts = [at[i] for i in checked]
                # rows not simply taken (refused, ended or failed) are few: the rest
                # go through in slices
                odd = [] if verdicts.count(1) == len(verdicts) else \
                    [k for k, v in enumerate(verdicts) if v != 1]
                if odd:
                    for k in odd:
                        seq, verdict = rows[k], verdicts[k]
                        if verdict == 0:
                            seq.pick_refused()  # masked until the model agrees with its grammar
                            self.premasker.premasked.pop(seq, None)  # (its masked pick is void)
                            refused.append(checked[k])
                            continue
                        if verdict == 2:  # taken, and the constraint is now done
                            seq.refusal_streak = 0
                            self.output.append_taken([seq], [tokens[k]], [2])
                            ok.add(seq)
                        else:  # the constraint failed (seq.error says how)
                            self.output.finish(seq, "abort")
                        outputs.append(seq)
                    rows, tokens = without(rows, odd), without(tokens, odd)
                if any(map(STREAK, rows)):  # (found in C: most steps no row has one)
                    for seq in rows:
                        seq.refusal_streak = 0  # a pick taken ends the streak of refusals
                self.output.append_taken(rows, tokens, quiet=taking.quiet)
                outputs += rows
                ok.update(rows)
                stats = self.stats
                stats.num_unmasked_picks += len(verdicts) - verdicts.count(-1)
                stats.num_refused_picks += len(refused)
                self.premasker.watch(taking, rows, tokens, refused)
        finally:
            taking.abandon()  # (the threads are done with the constraints before we go on)
        if refused and not taking.defer:
            rows, both, _ = self.rows.resample(prev, refused)  # (every refused row is an output)
            if rows:
                self.output.settle_on_host(rows, both)
            outputs.extend(seqs[i] for i in refused)
            refused = []
        return outputs, ok, refused
