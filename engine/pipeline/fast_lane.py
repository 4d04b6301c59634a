"""The fast lane: the usual pipelined step of a large constrained batch, its
critical path cut short.

It stays a path of its own beside :meth:`Pipeline.step`'s general one because
it launches the step after this one before the taken tokens are appended,
which the general order (take, then sample, then launch) cannot do: the device
then never waits for the host's appends.
"""

from __future__ import annotations

from concurrent.futures import wait
from typing import TYPE_CHECKING

import torch

from formcast.engine.pipeline.state import Ahead, Taking
from formcast.engine.sequence import Sequence

if TYPE_CHECKING:
    from formcast.engine.pipeline.pipeline import Pipeline


class FastLane:
    """A strategy of the pipelined step (see the module doc), and the step it
    launched ahead, for the next pipelined step to take."""

    def __init__(self, pipeline: "Pipeline") -> None:
        self.pipeline = pipeline
        self.ahead: Ahead | None = None

    def run(self, taking: Taking, launch: list[Sequence], logits: torch.Tensor,
                   picked: tuple) -> tuple[list[Sequence], list[Sequence]] | None:
        """The usual step of a large constrained batch, its critical path cut short.

        Every row of ``taking`` was sampled again (``picked``, as :meth:`RowSampler.sample`
        gave it for ``launch``, the same rows) while the accept thread checked the
        unmasked picks. Once every pick turns out taken or refused (none ending
        its constraint or failing), and no request ended or will end by the token
        it takes, the rows whose pick was refused are sampled again, this step's
        tokens are launched on their way to the host and the step after is
        launched on the device (:meth:`launch_ahead`), all before the taken
        tokens are appended, which the device no longer waits for. Returns the
        rows whose count of computed tokens filled a block (to hash once the
        tokens are appended) and the requests a failed resample settled; None
        (nothing done) when the step must go the ordinary way."""
        p, prev = self.pipeline, taking.prev
        seqs, tokens, checked = prev.seqs, taking.token_list, taking.checked
        if not taking.clean or len(taking.pending_rows) != len(checked) \
                or prev.finishes != p.output.num_finishes:
            return None
        # no row's token ends its request, and every row runs the step after: the
        # rows with a pick to append still count one token short of that
        eos = p.eos_token_ids
        every = len(checked) == len(seqs)
        ending = set()  # (rows whose token would end them: the lane goes on only if refused)
        if not taking.quiet:  # (quiet, the usual step: no row's token ends it)
            room = p.room_of(seqs)
            if room.quiet and room.tokens > 2:  # (only an end token ends a row)
                ending = {i for i in (range(len(seqs)) if every else checked)
                          if tokens[i] in eos}
            else:
                for i in range(len(seqs)) if every else checked:
                    s = seqs[i]
                    if not (s.ends_on_length_only and tokens[i] not in eos and s.first_token_time
                            and len(s.token_ids) + 2 < s.max_total_len):
                        ending.add(i)
        if not every:
            pending = set(checked)
            if any(len(s.token_ids) + 1 >= s.max_total_len
                   for i, s in enumerate(seqs) if i not in pending):
                return None
        # the step after this one, staged on the host while the accept thread
        # works, for the usual verdicts: every pick taken, every row one token on
        staged = p.block_manager.grow_decode(launch, ahead=1) and \
            p.runner.stage_decode_ahead(launch)
        slot = None
        if staged:
            # its inputs queued too (the picks it takes as they stand, every pick
            # taken): the launch after the verdicts is then the replay alone, which
            # reads nothing of the rows. So this step's picks start on their way to
            # the host now too: when every verdict is 1 nothing changes them, and
            # the replay goes before the rest
            both, _, watched, agree = picked[:4]
            if p.runner.preload_decode(both[0]):
                slot = p.copy_to_host(both, agree, len(watched))
        try:
            verdicts = taking.pending.result()
        except BaseException:
            return None  # (the take reports it)
        refused: list[int] = []
        if verdicts is None:
            return None
        if verdicts.count(1) != len(verdicts):
            if verdicts.count(0) + verdicts.count(1) != len(verdicts):
                return None  # a constraint ended or failed
            refused = [checked[k] for k, v in enumerate(verdicts) if not v]
        if not ending.issubset(refused):
            return None
        if refused and taking.ahead is not None:
            wait([taking.ahead[1]])  # (the mask thread is done before masks are filled here)
        filled: list[Sequence] = []
        first = slot is not None and not refused
        if first:
            # the step after first: what the device waits for (its inputs and this
            # step's copy to the host are queued already)
            self.launch_ahead(launch, picked[0][0], staged=True)
        settled = p.launch_sampled(prev, launch, logits, picked, set(), refused,
                                      p.output.num_finishes, filled=filled, slot=slot)
        if not first and not settled:
            self.launch_ahead(launch, p.inflight.tokens, staged=staged and not refused)
        return filled, settled

    def launch_ahead(self, seqs: list[Sequence], tokens: torch.Tensor, *,
                      staged: bool = False) -> None:
        """Launch the decode step after the one in flight for ``seqs``, on its sampled
        ``tokens`` on the device, as the next pipelined step would (it takes it
        when its rows are still these). Skipped when the blocks it opens are not
        free, or when it fails (the next step launches it again, and reports it).
        ``staged``: its blocks were grown and its inputs staged (see
        :meth:`ModelRunner.stage_decode_ahead`) before every row advanced."""
        p = self.pipeline
        if not staged and not p.block_manager.grow_decode(seqs):
            return
        mark = p.runner.decode_mark()
        try:
            logits = p.runner.execute_decode(seqs, tokens, staged=staged)
        except Exception:
            p.runner.rewind_decode(mark)
            return
        self.ahead = Ahead(seqs=seqs, logits=logits, mark=mark)
        p.stats.num_launched_ahead += 1

    def drop_ahead(self) -> None:
        """Forget the step launched ahead, if any (its rows changed, or an ordinary
        step comes): its output is never read, and the next replay reuses its place."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            self.pipeline.runner.rewind_decode(ahead.mark)
