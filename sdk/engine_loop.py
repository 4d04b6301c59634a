"""One background thread that owns an engine and serves requests from many event loops.

Coroutines (HTTP handlers, :class:`formcast.AsyncLLM` calls) hand their requests
to :meth:`EngineLoop.submit`; the loop's thread adds them to the engine between
steps, so they join the running batch (continuous batching across clients), and
sends every output back to the event loop of the coroutine that asked for it.
The thread is the only one that touches the engine while it has work: it holds
the :class:`formcast.LLM`'s lock for as long as requests are in flight, so
synchronous calls on the same model wait for it to be idle rather than stepping
the engine under it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from formcast.engine import RequestOutput, SamplingParams
from formcast.errors import EngineError, FormcastError, QueueFullError

log = logging.getLogger("formcast.engine_loop")


@dataclass
class LoopStats:
    """Counters of an :class:`EngineLoop` since it started (read for ``/metrics``).

    Attributes
    ----------
    requests_submitted, requests_finished, requests_failed, requests_aborted,
    requests_rejected : int
        Requests handed in; finished by the engine (any finish reason but abort);
        refused by the engine or failed in it; aborted by their caller; turned away
        because the queue was full.
    constrained_requests : int
        Of the submitted, those with a constraint.
    prompt_tokens, completion_tokens : int
        Over finished requests.
    steps, step_seconds : int, float
        Engine steps run and the time spent in them.
    """

    requests_submitted: int = 0
    requests_finished: int = 0
    requests_failed: int = 0
    requests_aborted: int = 0
    requests_rejected: int = 0
    constrained_requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    steps: int = 0
    step_seconds: float = 0.0


@dataclass(eq=False)
class Ticket:
    """A submitted request as its caller sees it: outputs arrive on ``queue``."""

    request_id: str
    stream: bool
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    done: bool = False

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Outputs until the final one (every change when streaming; else the final only).

        Raises
        ------
        FormcastError
            The engine refused the request or failed while running it.
        """
        while True:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return


@dataclass
class _Add:
    ticket: Ticket
    prompt_ids: list[int]
    params: SamplingParams
    constraint: Any


class EngineLoop:
    """Owns ``llm.engine`` on a background thread; see the module docstring.

    Parameters
    ----------
    llm : formcast.LLM
        The model whose engine this loop drives.
    max_pending : int
        Most requests in flight (queued or running) at once; beyond it
        :meth:`submit` raises :class:`QueueFullError`.
    """

    def __init__(self, llm: Any, *, max_pending: int = 256) -> None:
        if max_pending <= 0:
            raise ValueError(f"max_pending must be positive, got {max_pending}")
        self.llm, self.engine = llm, llm.engine
        self.max_pending = max_pending
        self.stats = LoopStats()
        self._cond = threading.Condition()
        self._commands: deque[_Add | str] = deque()  # adds, and request ids to abort
        self._tickets: dict[str, Ticket] = {}        # in the engine (owned by the thread)
        self._in_flight = 0                          # submitted and not yet delivered final
        self._closing = False
        self._thread: threading.Thread | None = None

    # -- life cycle -------------------------------------------------------------------
    def start(self) -> "EngineLoop":
        """Start the thread (no-op if running). Returns self."""
        if self._thread is None or not self._thread.is_alive():
            self._closing = False
            self._thread = threading.Thread(target=self._run, name="formcast-engine-loop",
                                            daemon=True)
            self._thread.start()
        return self

    def close(self, timeout: float | None = 30.0) -> None:
        """Abort what is in flight and stop the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def running(self) -> bool:
        """Whether the thread is serving."""
        return self._thread is not None and self._thread.is_alive() and not self._closing

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not yet answered."""
        return self._in_flight

    # -- callers' side ----------------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, *,
               constraint: Any = None, stream: bool = False) -> Ticket:
        """Queue one request for the engine (call from a coroutine).

        Parameters
        ----------
        prompt_ids : sequence of int
        params : SamplingParams
        constraint : LogitsConstraint | None
            A fresh matcher for this request.
        stream : bool
            Deliver every change of the output, not only the final one.

        Returns
        -------
        Ticket
            Await ``ticket.outputs()``; call :meth:`abort` with its id to stop it.

        Raises
        ------
        QueueFullError
            ``max_pending`` requests are in flight.
        EngineError
            The loop is not running.
        """
        ticket = Ticket(request_id=f"req-{uuid.uuid4().hex}", stream=stream,
                        loop=asyncio.get_running_loop())
        with self._cond:
            if self._thread is None or self._closing:
                raise EngineError("the engine loop is not running; call start() first")
            if self._in_flight >= self.max_pending:
                self.stats.requests_rejected += 1
                raise QueueFullError(f"{self._in_flight} requests are in flight (the limit is "
                                     f"{self.max_pending}); retry later")
            self._in_flight += 1
            self.stats.requests_submitted += 1
            self.stats.constrained_requests += constraint is not None
            self._commands.append(_Add(ticket, list(prompt_ids), params, constraint))
            self._cond.notify()
        return ticket

    def abort(self, ticket: Ticket) -> None:
        """Stop a request (a caller went away); frees its KV blocks. No-op once done."""
        if ticket.done:
            return
        with self._cond:
            self._commands.append(ticket.request_id)
            self._cond.notify()

    # -- the thread -------------------------------------------------------------------
    def _run(self) -> None:
        lock, engine = self.llm._lock, self.engine
        while True:
            with self._cond:
                while not self._commands and not self._closing:
                    self._cond.wait()
                if self._closing:
                    break
            with lock:  # (held while busy: synchronous calls wait for an idle engine)
                while True:
                    with self._cond:
                        commands, self._commands = self._commands, deque()
                        closing = self._closing
                    self._apply(commands)
                    if closing or not engine.has_unfinished_requests():
                        break
                    self._step()
        with lock:
            self._fail_all(EngineError("the engine loop was closed"))

    def _apply(self, commands: deque[_Add | str]) -> None:
        """Add the new requests to the engine and abort the cancelled ones."""
        failed: list[tuple[Ticket, BaseException]] = []
        for cmd in commands:
            if isinstance(cmd, str):
                ticket = self._tickets.pop(cmd, None)
                if ticket is not None:
                    self.engine.abort_request(cmd)
                    self._settle(ticket)
                    self.stats.requests_aborted += 1
                continue
            try:
                self.engine.add_request(cmd.prompt_ids, cmd.params, constraint=cmd.constraint,
                                        request_id=cmd.ticket.request_id)
            except Exception as exc:  # (refused alone: the loop and the batch go on)
                if not isinstance(exc, FormcastError):
                    exc = EngineError(f"the engine refused the request: "
                                      f"{type(exc).__name__}: {exc}")
                self._settle(cmd.ticket)
                failed.append((cmd.ticket, exc))
                self.stats.requests_failed += 1
                continue
            self._tickets[cmd.ticket.request_id] = cmd.ticket
        self._deliver(failed)

    def _step(self) -> None:
        streaming = any(t.stream for t in self._tickets.values())
        started = time.perf_counter()
        try:
            outputs = self.engine.step(finished_only=not streaming)
        except Exception as exc:  # the engine's state is uncertain: fail what it held
            log.exception("engine step failed")
            self._fail_all(EngineError(f"engine step failed: {type(exc).__name__}: {exc}"))
            return
        self.stats.steps += 1
        self.stats.step_seconds += time.perf_counter() - started
        ready: list[tuple[Ticket, Any]] = []
        for out in outputs:
            ticket = self._tickets.get(out.request_id)
            if ticket is None:
                continue  # (aborted by its caller)
            if out.finished:
                del self._tickets[out.request_id]
                self._settle(ticket)
                self._count(out)
                ready.append((ticket, out))
            elif ticket.stream:
                ready.append((ticket, out))
        self._deliver(ready)

    def _count(self, out: RequestOutput) -> None:
        stats = self.stats
        if out.finish_reason == "abort":
            stats.requests_failed += 1
        else:
            stats.requests_finished += 1
        stats.prompt_tokens += out.metrics.num_prompt_tokens
        stats.completion_tokens += out.metrics.num_output_tokens

    def _settle(self, ticket: Ticket) -> None:
        ticket.done = True
        with self._cond:
            self._in_flight -= 1

    def _fail_all(self, error: FormcastError) -> None:
        tickets, self._tickets = list(self._tickets.values()), {}
        for ticket in tickets:
            self.engine.abort_request(ticket.request_id)
            self._settle(ticket)
        with self._cond:
            commands, self._commands = self._commands, deque()
        for cmd in commands:
            if isinstance(cmd, _Add):
                self._settle(cmd.ticket)
                tickets.append(cmd.ticket)
        self.stats.requests_failed += len(tickets)
        self._deliver([(t, error) for t in tickets])

    @staticmethod
    def _deliver(items: list[tuple[Ticket, Any]]) -> None:
        """Put each item on its ticket's queue, one thread-safe call per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Ticket, Any]]] = {}
        for ticket, item in items:
            by_loop.setdefault(ticket.loop, []).append((ticket, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # (that event loop is closed: nobody is waiting)
                continue


def _put_all(batch: list[tuple[Ticket, Any]]) -> None:
    for ticket, item in batch:
        ticket.queue.put_nowait(item)
