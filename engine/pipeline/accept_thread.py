"""The accept thread: checks a large step's unmasked greedy picks against their
constraints as soon as the picks land in host memory, while the main thread goes
on to the next step; and the interpreter's switch interval while it does.
"""

from __future__ import annotations

import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from formcast.engine.constraint_ops import Acceptor
from formcast.engine.kernels import wait_event
from formcast.engine.pipeline.state import InFlight, wait_landed
from formcast.engine.tuning import EngineTuning


class AcceptThread:
    """A thread of its own (started on first use) with its :class:`Acceptor`,
    whose prepared batch accept serves it step after step."""

    def __init__(self, tuning: EngineTuning) -> None:
        self.tuning = tuning
        self.acceptor = Acceptor()  # (the native worker's launches use it too)
        self.pool: ThreadPoolExecutor | None = None
        self._switch_interval: float | None = None  # the process's, while ours is set

    def submit(self, step: InFlight) -> Future:
        """Check ``step``'s unmasked picks on the thread once they land; its
        ``landed`` event is set once the thread has read them."""
        step.landed = threading.Event()
        if self.pool is None:
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="formcast-accept")
        return self.pool.submit(self._check_landed, step)

    def _check_landed(self, step: InFlight) -> list[int] | None:
        """On the accept thread: wait for ``step``'s tokens, then offer its unmasked
        picks to their constraints; the verdicts of ``list(step.unchecked)``, or None
        when a row failed to sample (its take sorts that out first, then checks)."""
        try:
            if step.ready is not None:  # (landed already, the usual case: kept the lock)
                wait_event(step.ready)
            step.lists = token_list, dead_list = step.host.tolist()
            if any(dead_list):
                return None
        finally:
            step.landed.set()
        return self.acceptor(step.seqs, token_list, list(step.unchecked))

    def let_in(self, step: InFlight | None) -> None:
        """When ``step``'s tokens have landed and the accept thread has yet to
        start on them, wait until it has (it needs the interpreter lock for that,
        which this thread would otherwise keep up to a switch interval): its
        native accept then runs while this thread appends the last tokens."""
        if step is not None and step.landed is not None and not step.landed.is_set() and (
                step.ready is None or step.ready.query()):
            wait_landed(step)

    def quick_switches(self, on: bool) -> None:
        """While the accept thread checks picks, the interpreter offers the lock
        to a waiting thread after ``tuning.accept_switch_interval`` rather than
        its default: the accept thread needs it briefly before and after each
        native batch accept, and otherwise waits for the main thread's next
        torch call. The process's own interval is put back when the overlap ends
        (smaller batches, the pipeline drains, ``generate`` returns)."""
        if on == (self._switch_interval is not None):
            return
        if on:
            self._switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(min(self._switch_interval, self.tuning.accept_switch_interval))
        else:
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None
