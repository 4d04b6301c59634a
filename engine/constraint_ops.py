"""Batched operations over a step's constraints: the accept of many rows'
tokens at once (through a constraint class's batch hooks when it has them),
the native worker's check of landed picks, the mask thread, and the hooks a
constraint class may offer for its rows' first step.

The per-request protocol is :class:`formcast.engine.constraint.LogitsConstraint`;
what here goes beyond it falls back to looping over the rows.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from formcast.engine.constraint import as_acceptor, ops_for
from formcast.engine.sampler import FilledMasks, Sampler
from formcast.engine.sequence import Sequence


def rows_of(seqs: list[Sequence], tokens: list[int], rows: list[int]
             ) -> tuple[list[Sequence], list[int]]:
    """``seqs`` and ``tokens`` at ``rows`` (the lists themselves when that is all)."""
    if len(rows) == len(seqs):
        return seqs, tokens
    return [seqs[i] for i in rows], [tokens[i] for i in rows]


def accept_batch(seqs: list[Sequence], tokens: list[int]) -> list[int]:
    """Offer each of ``seqs`` its token in its constraint. Per row: 0 refused
    (state unchanged), 1 taken, 2 taken and the constraint is now
    terminated, -1 the constraint failed (``seq.error`` says how). A
    constraint class's ``accept_tokens`` hook takes all its rows in one call."""
    constraints = [seq.constraint for seq in seqs]
    kinds = set(map(type, constraints))
    if len(kinds) == 1:  # (the usual batch: one kind of constraint, one call)
        many = ops_for(kinds.pop()).accept_tokens
        if many is not None:
            return accept_many(many, seqs, constraints, tokens)
    verdicts = [0] * len(seqs)
    groups: dict = {}
    for j, seq in enumerate(seqs):
        many = ops_for(type(seq.constraint)).accept_tokens
        if many is not None:
            groups.setdefault(many, []).append(j)
            continue
        try:
            verdicts[j] = 0 if not seq.constraint.accept(tokens[j]) else \
                2 if seq.constraint.is_terminated() else 1
        except Exception as exc:
            seq.error, verdicts[j] = f"constraint failed: {type(exc).__name__}: {exc}", -1
    for many, rows in groups.items():
        got = accept_many(many, [seqs[j] for j in rows], [constraints[j] for j in rows],
                           [tokens[j] for j in rows])
        for j, verdict in zip(rows, got):
            verdicts[j] = verdict
    return verdicts


def prepare_constraints(scheduled) -> None:
    """Offer the constraint classes of ``scheduled``'s requests that have yet
    to take a token their optional ``prepare`` hook, once for each class's
    instances (xgrammar's matchers fork their grammar's start state there),
    while the device runs the step just launched: their prefill. (Made in the
    first accepts, they would hold up the batch's first masked steps; made with
    the matchers, before ``generate``, the device would idle meanwhile.)"""
    kinds: dict[type, list] = {}
    for item in scheduled:
        seq = item.seq
        if seq.constraint is not None and seq.first_token_time is None:
            kinds.setdefault(type(seq.constraint), []).append(seq.constraint)
    for kind, constraints in kinds.items():
        hook = ops_for(kind).prepare
        if hook is not None:
            try:
                hook(constraints)
            except Exception:  # (the constraints report it where they are used)
                pass


def forces_text(seq: Sequence) -> bool:
    """Whether ``seq``'s constraint, in the state it picked its last token in
    (not taken yet), fixed that token's text (its optional ``forces_text`` hook;
    False without one, or when it fails: the agreement then counts).

    A request masked since its unmasked pick broke its grammar goes back to
    unmasked picks once its masked pick is its model's argmax. Where the grammar
    fixes the text (a key, its punctuation) the two often meet by chance, and
    the next unmasked pick is refused at once (a step of the row lost). Counted
    only where the grammar leaves a choice, the rows stay masked through the
    punctuation, with the same tokens."""
    constraint = seq.constraint
    try:
        return bool(ops_for(type(constraint)).forces_text(constraint))
    except Exception:
        return False


def narrow_choice(seq: Sequence) -> bool:
    """Whether ``seq``'s constraint, in the state it picked its last token in
    (not taken yet), allowed few tokens there: its optional ``narrow_choice``
    hook (fewer than half the vocabulary's tokens), else :func:`forces_text`.
    An agreement there does not end a row's masking.

    Where a grammar leaves few tokens (a number's digits, punctuation, a key) a
    masked pick often meets its model's argmax by chance, and the row's next
    pick, unmasked, is a gamble (a digit past a schema's maximum, refused: a
    step lost, and the batch's last step waiting on that row). Counted only
    where the grammar leaves a wide choice, an agreement on a digit leaves the
    row masked through the number."""
    constraint = seq.constraint
    try:
        return bool(ops_for(type(constraint)).narrow_choice(constraint))
    except Exception:
        return False



def accept_many(many, seqs: list[Sequence], constraints: list, tokens: list[int]
                 ) -> list[int]:
    """A constraint class's ``accept_tokens`` hook over ``seqs``' ``constraints``:
    its verdicts, or -1 for every row (with ``seq.error`` set) when it fails or
    answers for another number of rows (which of them moved is unknown)."""
    try:
        got = many(constraints, tokens)
        if len(got) != len(seqs):
            raise ValueError(f"accept_tokens gave {len(got)} verdicts for {len(seqs)} tokens")
        return got
    except Exception as exc:
        for seq in seqs:
            seq.error = f"constraint failed: {type(exc).__name__}: {exc}"
        return [-1] * len(seqs)


class Acceptor:
    """The accept of a pipelined step's tokens by rows that stay the same from
    step to step (the accept thread's check of a large batch's unmasked picks,
    and the take of the rows sampled under their masks, all of a batch's rows in
    its opening): :func:`accept_batch`, through the rows' constraint
    class's ``batch_acceptor`` hook when they share one, its per-row preparation
    made again only when the rows change. A hook that raises, when prepared or
    called, fails every request of the call, as ``accept_tokens``.

    A call may offer tokens to some of the rows only (``at``): the unmasked
    picks of a batch some of whose rows are masked, those rows changing from
    step to step. The preparation is then for all the rows, and a prepared
    hook's ``subset`` (when it has one) makes the part for those rows from it,
    rather than each step preparing afresh (the accept thread holds the
    interpreter lock meanwhile, which the main thread waits for)."""

    __slots__ = ("seqs", "every", "hook", "prepared", "failure", "index", "part", "part_rows")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Let go of the rows (the next call prepares for its own)."""
        self.seqs = self.every = self.hook = self.prepared = self.failure = self.index = None
        self.part = self.part_rows = None

    def __call__(self, seqs: list[Sequence], tokens: list[int], at: list[int] | None = None
                 ) -> list[int]:
        """The verdicts of ``seqs[i]`` taking ``tokens[i]`` for ``i`` in ``at``
        (None: every row), in that order."""
        if at is not None and not at:
            return []
        if self.seqs != seqs:  # (identity compares, in C)
            self._prepare(seqs)
        if at is not None and len(at) == len(seqs) and at == self.every:
            at = None
        if at is None and self.index is None:
            if self.prepared is None and self.failure is None:
                return accept_batch(seqs, tokens)
            return accept_many(self._hook, seqs, None, tokens)
        if at is None:
            at = self.every
        rows, tokens = rows_of(seqs, tokens, at)
        index = at if self.index is None else [self.index[i] for i in at]
        if self.failure is not None:
            return accept_many(self._hook, rows, None, tokens)
        if self.hook is None or min(index) < 0:  # (no hook: the rows alone)
            return accept_batch(rows, tokens)
        try:
            part = self._part(index, rows)
        except Exception as exc:
            return accept_many(raise_hook(exc), rows, None, tokens)
        return accept_many(lambda _constraints, tokens: part(tokens), rows, None, tokens)

    def _part(self, index: list[int], rows: list[Sequence]):
        """The prepared hook for the constrained rows at ``index`` (of the
        preparation's), ``rows`` their sequences: made from the preparation
        when the rows change (a hook without subsets: prepared for the rows
        themselves). Raises what the hook raises."""
        if self.part_rows != index:
            try:
                part = self.prepared.subset(index)
                self.part = part if part is not None else \
                    as_acceptor(self.hook([s.constraint for s in rows]))
                self.part_rows = index
            except Exception:
                self.part = self.part_rows = None
                raise
        return self.part

    def launch(self, seqs: list[Sequence], at: list[int], host: torch.Tensor, poll
               ) -> "NativeCheck | None":
        """The accept of ``seqs[i]`` taking ``host[0, i]`` for ``i`` in ``at``, on
        the constraint class's native worker as soon as ``poll`` (see
        :func:`kernels.event_poll`; None: now) says the tokens landed in ``host``
        (``[2, len(seqs)]``: tokens, dead-end flags). None when the rows'
        prepared hook has no ``launch`` or declines (the caller checks them
        itself)."""
        if not at:
            return None
        if self.seqs != seqs:  # (identity compares, in C)
            self._prepare(seqs)
        if self.failure is not None or self.hook is None:
            return None
        index = at if self.index is None else [self.index[i] for i in at]
        if min(index) < 0:
            return None
        rows = seqs if len(at) == len(seqs) else [seqs[i] for i in at]
        try:
            part = self.prepared if index == self.every else self._part(index, rows)
            job = part.launch(host, at, poll)
        except Exception:  # (the ordinary check reports it)
            return None
        return None if job is None else NativeCheck(job, rows)

    def _prepare(self, seqs: list[Sequence]) -> None:
        """The hook's preparation for the constrained ones of ``seqs`` (the rest
        are never offered a token: their ``index`` entry is -1)."""
        self.seqs, self.prepared, self.failure, self.index = list(seqs), None, None, None
        self.every = list(range(len(seqs)))
        self.part = self.part_rows = None
        constraints = [s.constraint for s in seqs if s.constraint is not None]
        if len(constraints) < len(seqs):
            at = itertools.count()
            self.index = [next(at) if s.constraint is not None else -1 for s in seqs]
        kinds = set(map(type, constraints))
        hook = self.hook = \
            ops_for(kinds.pop()).batch_acceptor if len(kinds) == 1 else None
        if hook is not None:
            try:
                self.prepared = as_acceptor(hook(constraints))
            except Exception as exc:
                self.failure = exc

    def _hook(self, _constraints, tokens: list[int]) -> list[int]:
        """The prepared hook as :func:`accept_many` calls one."""
        if self.failure is not None:
            raise self.failure
        return self.prepared(tokens)


class NativeCheck:
    """The verdicts of a step's unmasked picks, checked by the constraint
    class's native worker (see :meth:`Acceptor.launch`), as the accept
    thread's future gives them: ``result()`` the verdicts (a failed constraint:
    -1 for every row, ``seq.error`` set, as :func:`accept_many`), or None when a
    row failed to sample (no constraint moved)."""

    __slots__ = ("job", "rows")

    def __init__(self, job, rows: list[Sequence]) -> None:
        self.job, self.rows = job, rows

    def done(self) -> bool:
        return self.job.done()

    def wait(self) -> None:
        """Until the worker is through with the constraints."""
        self.job.wait()

    def result(self) -> list[int] | None:
        rows = self.rows
        try:
            verdicts = self.job.result()
        except Exception as exc:
            return accept_many(raise_hook(exc), rows, None, [0] * len(rows))
        if verdicts is None:
            return None
        return accept_many(lambda _constraints, _tokens: verdicts, rows, None, verdicts)


def raise_hook(exc: Exception):
    """A hook, as :func:`accept_many` calls one, that raises ``exc``."""
    def hook(_constraints, _tokens):
        raise exc
    return hook


class MaskThread:
    """Fills masks on a thread of its own (the grammar libraries let go of the
    interpreter lock while they fill), started on first use."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, seqs: list[Sequence]) -> "Future[FilledMasks]":
        """``seqs``' masks, filled on the mask thread: a future."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="formcast-masks")
        return self._pool.submit(self.sampler.fill_masks, seqs)
