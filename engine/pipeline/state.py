"""The state of asynchronous steps: a step in flight, the one launched ahead of
it, a take in progress, what a run of steps found of its rows, and the pinned
host buffers the steps' tokens land in.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence as SequenceABC
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

import torch

from formcast.engine.constraint_ops import NativeCheck
from formcast.engine.sequence import Sequence


@dataclass(slots=True)
class PipelineStats:
    """Counts of what the asynchronous steps did (for tests and benchmarks)."""

    num_pipelined_steps: int = 0  # steps launched before the host had their input
    num_launched_ahead: int = 0  # of those, launched before the last tokens were appended
    # greedy picks made without masks for constrained rows, and those refused
    # (EngineConfig.unmasked_greedy)
    num_unmasked_picks: int = 0
    num_refused_picks: int = 0
    num_native_accepts: int = 0  # steps' accepts launched on the native worker
    num_premasked_picks: int = 0  # picks made under a mask by premasking


@dataclass(slots=True)
class Room:
    """What :meth:`Pipeline.room_of` found of a list of rows."""

    seqs: list[Sequence]
    tokens: int   # every row has room for at least this many more tokens
    quiet: bool   # every row ends on its length only and has its first token
    steps: int    # PipelineStats.num_pipelined_steps when found
    unstarted: bool = False  # a row had yet to take its first token


class HostSlots:
    """Pinned host buffers that pipelined steps' tokens and agreement flags are
    copied into, and the events that fire once they are filled: two sets, used
    in turn, since a step's set is read before the step after next is sampled
    (pinned memory and an event made for every step cost tens of microseconds
    of the host's time a step)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._tokens = [torch.empty(2 * rows, dtype=torch.long, pin_memory=True)
                        for _ in range(2)]
        self._flags = [torch.empty(rows, dtype=torch.bool, pin_memory=True) for _ in range(2)]
        self._events = [torch.cuda.Event(), torch.cuda.Event()]
        self._turn = 0

    def next(self, n: int, watched: int
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.cuda.Event]:
        """The next set: ``[2, n]`` tokens, ``[watched]`` flags (None for 0), its event."""
        if n > self.rows:  # (more rows than running requests can be; watched <= n)
            flags = torch.empty(watched, dtype=torch.bool, pin_memory=True) if watched else None
            return (torch.empty(2, n, dtype=torch.long, pin_memory=True), flags,
                    torch.cuda.Event())
        k = self._turn
        self._turn ^= 1
        return (self._tokens[k][:2 * n].view(2, n),
                self._flags[k][:watched] if watched else None, self._events[k])


@dataclass(eq=False, kw_only=True)
class InFlight:
    """A decode step launched and sampled on the device whose tokens the host has
    not taken yet."""

    seqs: list[Sequence]            # its rows, in order
    tokens: torch.Tensor            # [B] long, on the device: the next step's input
    host: torch.Tensor              # [2, B] long (tokens, dead-end flags), being copied in
    ready: torch.cuda.Event | None  # fires once ``host`` is filled (None off CUDA)
    # rows given an unmasked greedy pick their constraint has yet to check, each
    # to its row of ``logits`` (kept to sample it again under its mask if refused)
    unchecked: dict[int, int] = field(default_factory=dict)
    logits: torch.Tensor | None = None
    # masked greedy rows (after a refused pick) and, being copied in, whether each
    # one's masked pick was its unmasked argmax: those go back to unmasked picks
    watched: list[int] = field(default_factory=list)
    agree: torch.Tensor | None = None
    # every row is in exactly one of: ``unchecked``, ``free`` (no constraint),
    # ``masked`` (constrained, sampled under its mask), in row order
    free: list[int] = field(default_factory=list)
    masked: list[int] = field(default_factory=list)
    finishes: int = 0  # OutputProcessor.num_finishes when launched: a request may have ended since
    # rows in none of those: requests that ended since (dropped when taken), and
    # ``void`` ones, settled by a failed resample (drawn from a state left behind)
    void: set[int] = field(default_factory=set)
    # the verdicts of ``unchecked``'s picks, on the constraints' native worker or the
    # accept thread from the moment they land (``landed``: the thread read them)
    early: "Future | NativeCheck | None" = None
    landed: threading.Event | None = None
    lists: list | None = None


@dataclass(eq=False, kw_only=True)
class Ahead:
    """A decode step launched before the host appended its input tokens' step
    (:meth:`Pipeline.fast_lane`), for the next pipelined step to take."""

    seqs: list[Sequence]  # its rows, in order
    logits: torch.Tensor
    mark: int             # the model runner's decode mark before it (to rewind)


@dataclass(eq=False, kw_only=True)
class Taking:
    """A step in flight being taken, between :meth:`Taker.begin` and
    :meth:`Taker.end`."""

    prev: InFlight
    token_list: list[int]  # its tokens, on the host
    checked: list[int]     # its rows with unmasked picks their constraints check
    defer: bool            # refused picks are sampled again by the caller
    outputs: list[Sequence] = field(default_factory=list)
    ok: set[Sequence] = field(default_factory=set)  # requests that took their token
    # verdicts of ``pending_rows``' picks, on the accept thread or the native worker
    pending: "Future | NativeCheck | None" = None
    pending_rows: list[int] = field(default_factory=list)
    ahead: tuple[list[Sequence], Future] | None = None  # the next masks, on the mask thread
    clean: bool = True  # every row sampled, none voided, no request ended since the launch
    sampled: bool = False  # the step after it was sampled before its verdicts came
    # no row's token can end its request (see Pipeline.room_of; no end token among
    # them): a row that took its token appends it plainly
    quiet: bool = False

    def abandon(self) -> None:
        """Wait for the threads working on its constraints (their errors show
        where their results are read)."""
        futures = [f for f in (self.pending, self.ahead and self.ahead[1]) if f is not None]
        for f in futures:
            if isinstance(f, NativeCheck):
                f.wait()
            else:
                wait([f])


def without(items: SequenceABC, drop: list[int]) -> list:
    """``items`` but those at ``drop`` (ascending indices): a few slices."""
    out, start = [], 0
    for k in drop:
        out += items[start:k]
        start = k + 1
    out += items[start:]
    return out


def wait_landed(step: "InFlight") -> None:
    """Wait until the accept thread has read ``step``'s tokens (or is done with it)."""
    while not step.landed.wait(0.05):
        if step.early.done():  # (a job that never ran: the caller reads the tokens itself)
            return
