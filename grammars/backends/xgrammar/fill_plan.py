"""Whether a batch of masks is filled on one thread or spread over a few."""

from __future__ import annotations

import threading
import time

import torch
import xgrammar as xgr

from formcast.grammars.backends.xgrammar.tuning import XGrammarTuning


class FillPlan:
    """Whether a batch of masks is filled on one thread or spread over a few.

    xgrammar's threads pay off only for costly rows (a JSON string's states):
    for cheap ones (forced punctuation) the hand-off costs more than the rows.
    So a batch goes to the threads when one thread's time for it, estimated
    from the per-row time one thread took last, is above the tuning's
    ``fill_parallel_us``. The estimate follows the rows' states: a batch the
    threads filled at under ``fill_cheap_us`` a row sends the next batch to one
    thread, and so does every ``fill_probe``-th batch.

    Parameters
    ----------
    threads : int
        xgrammar threads for costly batches (1: always one thread).
    tuning : XGrammarTuning or None
        The thresholds (default: the defaults).
    """

    def __init__(self, threads: int, tuning: XGrammarTuning | None = None) -> None:
        tuning = XGrammarTuning() if tuning is None else tuning
        self.parallel_us = tuning.fill_parallel_us
        self.cheap_us = tuning.fill_cheap_us
        self.probe = tuning.fill_probe
        self.one = xgr.BatchGrammarMatcher(max_threads=1)
        self.many = xgr.BatchGrammarMatcher(max_threads=threads) if threads > 1 else None
        self.us_per_row = 2.0  # one thread's, last measured
        self.spread = 0        # batches in a row sent to the threads

    def fill(self, matchers: list[xgr.GrammarMatcher], bitmask: torch.Tensor,
             rows: list[int]) -> None:
        """Fill ``bitmask[rows[k]]`` with ``matchers[k]``'s mask (changes ``bitmask``
        and this plan's estimate)."""
        n = len(rows)
        start = time.perf_counter()
        if self.many is not None and self.us_per_row * n > self.parallel_us and \
                self.spread < self.probe - 1:
            self.spread += 1
            self.many.batch_fill_next_token_bitmask(matchers, bitmask, rows)
            if (time.perf_counter() - start) * 1e6 < self.cheap_us * n:
                self.spread = self.probe  # cheap rows now: measured on one thread next
            return
        self.spread = 0
        self.one.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        self.us_per_row = (time.perf_counter() - start) * 1e6 / max(n, 1)


class FillPlans:
    """A :class:`FillPlan` per thread (the engine fills on two at once), made on
    first use; owned by a backend."""

    def __init__(self, tuning: XGrammarTuning) -> None:
        self.tuning = tuning
        self._local = threading.local()

    def get(self) -> FillPlan:
        """The calling thread's plan."""
        plan = getattr(self._local, "plan", None)
        if plan is None:
            plan = self._local.plan = FillPlan(self.tuning.fill_thread_count, self.tuning)
        return plan
