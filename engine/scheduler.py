"""Continuous batching: which requests run this step, and how many tokens each.

Every step has a token budget. Running sequences go first (a decode costs one
token, an unfinished prompt costs its next chunk); waiting ones are admitted while
budget, batch slots and KV blocks last. When blocks run out, the most recently
admitted running sequence is preempted: its blocks are freed and it goes back to
the front of the queue, to be recomputed later (its tokens are kept).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from formcast.engine.block_manager import BlockManager
from formcast.engine.kv_groups import GroupedBlockManager
from formcast.engine.sequence import SamplingEpochs, Sequence, SequenceStatus


@dataclass(frozen=True, kw_only=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # new tokens computed this step, from seq.num_computed_tokens on
    num_draft: int = 0  # of them, speculative draft tokens after the sequence's end

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence (so a token is sampled)."""
        return self.seq.num_computed_tokens + self.num_tokens - self.num_draft == len(self.seq)


@dataclass(frozen=True, kw_only=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    """Waiting and running queues over a :class:`BlockManager` (or one per KV
    group of a model with sliding-window layers: :class:`GroupedBlockManager`)."""

    def __init__(self, block_manager: BlockManager | GroupedBlockManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.epochs = SamplingEpochs()  # (its sequences' ways of sampling: see Sequence)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            d = self._fit_draft(seq, budget)
            n = min(seq.num_uncomputed_tokens + d, budget)
            while not bm.can_grow(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                bm.grow(seq, n)
                scheduled.append(ScheduledSeq(seq=seq, num_tokens=n, num_draft=d))
                budget -= n
                i += 1
                continue
            break  # seq preempted itself: it was the last running one

        # admit waiting requests, unless this step already had to preempt
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            if not seq.block_table:
                seq.num_cached_prompt_tokens = max(seq.num_cached_prompt_tokens,
                                                   bm.allocate_prefix(seq))
            n = min(seq.num_uncomputed_tokens, budget)
            if not bm.can_grow(seq, n):
                bm.free(seq)  # give back reused prefix blocks; retry on a later step
                break
            bm.grow(seq, n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.perf_counter()
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq=seq, num_tokens=n))
            budget -= n
        return SchedulerOutput(scheduled=scheduled, preempted=preempted)

    def _fit_draft(self, seq: Sequence, budget: int) -> int:
        """Draft tokens of ``seq`` to verify this step: its draft, cut to the token
        budget and the free KV blocks (a draft never preempts anyone); 0 if none."""
        draft = seq.draft
        if draft is None or not draft.tokens or seq.num_uncomputed_tokens != 1:
            seq.draft = None
            return 0
        d = min(len(draft), budget - 1)
        while d > 0 and not self.block_manager.can_grow(seq, 1 + d):
            d -= 1
        seq.draft = draft.cut(d) if d else None
        return d

    def on_step_done(self, out: SchedulerOutput) -> None:
        """Record the tokens computed by the step that ran ``out`` (draft positions
        count once verification has accepted them)."""
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_tokens - item.num_draft
            # (and a sliding group gives back the blocks that left its window)
            self.block_manager.commit(item.seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished, drop it from its queue and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finished_time = time.perf_counter()

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
