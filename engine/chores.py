"""The host's chores while it waits for the device: hashing full KV blocks,
opening the next ones early, constraint housekeeping, dropping ended requests'
constraints and detokenizing deferred tokens.

Each chore goes a few rows at a time while ``busy()`` says the device still
runs the step in flight, so none of it lands on a step's critical path.
"""

from __future__ import annotations

from collections.abc import Callable

from formcast.engine.block_manager import BlockManager
from formcast.engine.constraint import LogitsConstraint, ops_for
from formcast.engine.sequence import Sequence
from formcast.engine.tuning import EngineTuning


class HostChores:
    """Work that can wait for the host's idle moments.

    Parameters
    ----------
    block_manager : BlockManager
        Whose deferred block hashes and early opens are done here.
    tuning : EngineTuning
        How many rows a chore takes at a time.
    graves : list[LogitsConstraint]
        Ended requests' constraints, kept to be dropped here
        (:attr:`formcast.engine.output.OutputProcessor.graves`).
    """

    def __init__(self, block_manager: BlockManager, tuning: EngineTuning,
                 graves: list[LogitsConstraint]) -> None:
        self.block_manager = block_manager
        self.tuning = tuning
        self.graves = graves
        self.detok_at = 0  # the row detokenize_while goes on from
        # (rows, their constraint classes' tidy hooks) of the last step that waited
        self._tidy_hooks: tuple[list[Sequence], list] | None = None

    def while_busy(self, seqs: list[Sequence], busy: Callable[[], bool]) -> None:
        """Every chore in turn, while ``busy()``, for a step in flight over ``seqs``."""
        self.commit_while(busy)
        self.open_while(seqs, busy)
        self.tidy_constraints(seqs)
        self.bury_while(busy)
        if self.tuning.detok_chore_tokens:
            self.detokenize_while(seqs, busy)

    def forget(self) -> None:
        """Let go of the rows (no request is left)."""
        self._tidy_hooks = None

    def commit_while(self, busy: Callable[[], bool]) -> None:
        """Hash the full blocks that decode steps filled (see
        :meth:`BlockManager.defer_commits`), a few sequences at a time."""
        bm = self.block_manager
        while bm.num_deferred and busy():
            bm.commit_deferred(self.tuning.commit_chore_rows)

    def commit_quota(self) -> None:
        """Hash some of the blocks left unhashed, the step's launches made (a host
        with no wait to do it in still drains a batch's blocks in a few steps,
        not at the batch's end, where its requests are freed)."""
        if self.block_manager.num_deferred:
            self.block_manager.commit_deferred(self.tuning.commit_quota_rows)

    def open_while(self, seqs: list[Sequence], busy: Callable[[], bool]) -> None:
        """Open the next KV block of ``seqs``' rows that will need one soon
        (:meth:`BlockManager.open_early`), a few rows at a time, a round of the
        rows at most."""
        bm = self.block_manager
        while busy() and bm.open_early(seqs, self.tuning.open_chore_rows):
            pass

    def tidy_constraints(self, seqs: list[Sequence]) -> None:
        """Offer the constraint classes of ``seqs``' rows their optional ``tidy``
        hook (housekeeping that would otherwise fall on a step's path). The hooks
        are looked up once for as long as the rows stay the same."""
        kept = self._tidy_hooks
        if kept is None or kept[0] != seqs:  # (identity compares, in C)
            kinds = {type(s.constraint) for s in seqs if s.constraint is not None}
            hooks = [h for h in (ops_for(k).tidy for k in kinds) if h is not None]
            kept = self._tidy_hooks = (list(seqs), hooks)
        for hook in kept[1]:
            try:
                hook()
            except Exception:  # (the constraints report it where they are used)
                pass

    def bury_while(self, busy: Callable[[], bool]) -> None:
        """Drop the constraints of ended requests kept in :attr:`graves`, a few at
        a time: their destructors then run off the caller's path (their last
        references are often the caller's, let go as ``generate`` returns)."""
        graves = self.graves
        while graves and busy():
            del graves[-self.tuning.graves_at_once:]

    def detokenize_while(self, seqs: list[Sequence], busy: Callable[[], bool]) -> None:
        """Make the text of ``seqs``' deferred tokens (see
        :meth:`Sequence.defer_text`), a few rows at a time, each row once it has
        ``tuning.detok_chore_tokens`` of them, so that a batch's rows that end
        together have a few tokens each left to detokenize, not their whole
        output. The rows are taken in turn from where the last call stopped.
        (Not while waiting for the native worker's verdicts: that wait lets go
        of the interpreter lock, which the mask and accept threads want then.)"""
        n = len(seqs)
        if not n:
            return
        at = self.detok_at % n
        left = n  # (one pass over the rows at most)
        step, enough = self.tuning.detok_chore_rows, self.tuning.detok_chore_tokens
        while left > 0 and busy():
            chunk = seqs[at:at + step]
            made = False
            for s in chunk:
                if len(s._undecoded) >= enough:
                    s.text  # (reading it makes it)
                    made = True
            at = (at + len(chunk)) % n
            left -= len(chunk)
            if not made:  # (rows take their tokens in step: the next ones have none either)
                break
        self.detok_at = at
