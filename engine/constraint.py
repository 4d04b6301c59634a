"""The one interface between the engine and the grammar layer.

The engine imports no grammar library: it drives any object that implements
:class:`LogitsConstraint`. ``formcast.grammars`` provides the real matchers.
What a constraint may do beyond the protocol (fill or accept many rows in one
call, answer how wide its next choice is, fork, explain a dead end) is typed by
:class:`BaseConstraint`, whose defaults do what the engine does without them;
the engine finds a class's operations once per class with :func:`ops_for`, so a
bare :class:`LogitsConstraint` works unchanged.
"""

from __future__ import annotations

import functools
import operator
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class LogitsConstraint(Protocol):
    """A per-request token filter with state (one instance per request)."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed tokens of the next step into ``bitmask[row]``.

        ``bitmask`` is int32 ``[rows, ceil(V/32)]``; bit ``t % 32`` of word ``t // 32``
        set means token ``t`` is allowed.
        """

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (state unchanged) if it is not allowed.

        It must take exactly the tokens :meth:`fill_bitmask` allows: a greedy
        request's unmasked pick is checked by ``accept`` alone
        (``EngineConfig.unmasked_greedy``)."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    def is_terminated(self) -> bool:
        """True once the constraint is complete and accepts nothing more."""

    def forced_tokens(self) -> list[int]:
        """Tokens the constraint fixes from here on (jump-forward); may be empty."""

    def valid_prefix(self, draft: list[int]) -> int:
        """How many leading tokens of ``draft`` the constraint allows (state unchanged)."""


class BatchAcceptor:
    """A prepared accept of one token by each of a fixed list of constraints
    (what :meth:`BaseConstraint.batch_acceptor` gives): called with a token per
    constraint, it changes their states and gives per row 0 (refused, state
    unchanged), 1 (taken) or 2 (taken, and the constraint is now terminated)."""

    __slots__ = ()

    def __call__(self, tokens: list[int]) -> list[int]:
        raise NotImplementedError

    def subset(self, rows: list[int]) -> "BatchAcceptor | None":
        """This accept for the constraints at ``rows`` only, made from its
        preparation; None (the default) when it cannot (the engine then asks the
        class for a fresh one)."""
        return None

    def launch(self, host: torch.Tensor, cols: list[int], poll: Any) -> Any:
        """This accept of the tokens at columns ``cols`` of ``host`` (``[2, B]``
        int64: tokens, then dead-end flags) run off the interpreter as soon as
        ``poll`` says they landed: a job with ``done``, ``wait`` and ``result``
        (the verdicts, or None when a row failed to sample). None (the default):
        the engine checks the tokens itself."""
        return None


class CallableAcceptor(BatchAcceptor):
    """A plain function of the tokens as a :class:`BatchAcceptor` (no subsets, no launch)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[list[int]], list[int]]) -> None:
        self.fn = fn

    def __call__(self, tokens: list[int]) -> list[int]:
        return self.fn(tokens)


def as_acceptor(prepared: Any) -> BatchAcceptor:
    """``prepared`` (a ``batch_acceptor``'s answer) as a :class:`BatchAcceptor`."""
    return prepared if isinstance(prepared, BatchAcceptor) else CallableAcceptor(prepared)


class BaseConstraint(ABC):
    """The typed optional side of the contract: a :class:`LogitsConstraint` with
    the batch operations of its class and the per-instance hooks the engine may
    use, each with a default that does what the engine does without it.

    A constraint need not derive from it: the engine drives any
    :class:`LogitsConstraint` with these defaults (see :func:`ops_for`). A class
    overrides what it can do faster or knows better; the class-level ones may be
    class or static methods.
    """

    __slots__ = ()

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """As :meth:`LogitsConstraint.fill_bitmask`."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """As :meth:`LogitsConstraint.accept`."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """As :meth:`LogitsConstraint.rollback`."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """As :meth:`LogitsConstraint.is_terminated`."""

    @abstractmethod
    def forced_tokens(self) -> list[int]:
        """As :meth:`LogitsConstraint.forced_tokens`."""

    @abstractmethod
    def valid_prefix(self, draft: list[int]) -> int:
        """As :meth:`LogitsConstraint.valid_prefix`."""

    # -- class-level batch operations --------------------------------------------

    @classmethod
    def fill_bitmasks(cls, constraints: list, bitmask: torch.Tensor,
                      rows: list[int]) -> None:
        """Fill ``bitmask[rows[i]]`` for ``constraints[i]``, each row written whole
        (the engine does not clear them first). On CUDA the engine uses it for a
        step's rows of the class; if it raises, the rows are cleared and filled
        one by one so only a broken constraint fails. Default: that loop."""
        rows = list(rows)
        bitmask[rows] = 0
        for constraint, row in zip(constraints, rows):
            constraint.fill_bitmask(bitmask, row)

    @classmethod
    def fill_distinct_bitmasks(cls, constraints: list, bitmask: torch.Tensor
                               ) -> list[int] | None:
        """Fill one row of ``bitmask`` per distinct state among ``constraints``
        (rows ``0..k-1`` written whole) and give the row holding each one's mask
        (None: row ``i`` is constraint ``i``'s). Preferred on CUDA when a step's
        constrained rows are all of the class. Default: :meth:`fill_bitmasks`."""
        cls.fill_bitmasks(constraints, bitmask, list(range(len(constraints))))
        return None

    @classmethod
    def accept_tokens(cls, constraints: list, tokens: list[int]) -> list[int]:
        """Accept ``tokens[i]`` into ``constraints[i]``: per row 0 (refused, state
        unchanged), 1 (taken) or 2 (taken, now terminated). Used for a pipelined
        step's unmasked greedy picks; if it raises, every constraint of the call
        fails its request. Default: one ``accept`` per row."""
        return [0 if not c.accept(t) else 2 if c.is_terminated() else 1
                for c, t in zip(constraints, tokens)]

    @classmethod
    def batch_acceptor(cls, constraints: list) -> BatchAcceptor:
        """:meth:`accept_tokens` prepared for a fixed list of constraints, called
        once a step for as long as the same rows run (the per-constraint
        preparation paid once). Verdicts and failures as :meth:`accept_tokens`."""
        constraints = list(constraints)
        return CallableAcceptor(lambda tokens: cls.accept_tokens(constraints, tokens))

    @classmethod
    def prepare(cls, constraints: list) -> None:
        """Ready ``constraints`` for their first step; the engine calls it once
        their prefill is on its way to the device. Default: nothing."""

    @classmethod
    def tidy(cls) -> None:
        """Housekeeping the engine runs while the device is busy. Default: nothing."""

    # -- per-instance hooks ------------------------------------------------------

    def forces_text(self) -> bool:
        """Whether the next bytes of text are fixed whatever token comes (a JSON
        key, punctuation): a masked pick that meets the model's argmax there shows
        nothing of how well the model follows the grammar, and does not end the
        row's masking. Default: False."""
        return False

    def narrow_choice(self) -> bool:
        """Whether fewer than half of the vocabulary's tokens are allowed next
        (forced text among them): as :meth:`forces_text`, an agreement there does
        not end a row's masking. Default: :meth:`forces_text`."""
        return self.forces_text()

    def rollback_hint(self) -> int:
        """Tokens to roll back to leave a dead end an end check caused (0: none)."""
        return 0

    @property
    def last_violation(self) -> str | None:
        """Why the finished value failed its end check, for the error (None: it did not)."""
        return None

    def take_forced_tokens(self, limit: int) -> list[int]:
        """Accept the tokens the constraint fixes from here, at most ``limit``,
        and give them (the engine's jump-forward at a request's start). Default:
        :func:`accept_forced_tokens`."""
        return accept_forced_tokens(self, limit)

    def fork(self) -> LogitsConstraint | None:
        """An independent copy in the same state (draft masks are made on one);
        None (the default): the constraint cannot fork."""
        return None

    # -- spans: where a model that does not follow the grammar errs -------------

    @classmethod
    def span_closing_tokens(cls, token_bytes: Sequence[bytes]) -> frozenset[int] | None:
        """The tokens (of a vocabulary spelled ``token_bytes``) that may close a
        span of free text in this class's languages (a JSON string), after
        which the grammar wants a narrow choice (punctuation): where a model
        that writes the span's inside well but ignores the grammar breaks it.
        The engine's premasking watches the picks after them (see
        :meth:`closes_span`); asked once per class. None (the default): the
        class has no spans."""
        return None

    def closes_span(self, token_ids: list[int], start: int, end: int, token: int) -> bool:
        """Whether ``token`` (one of :meth:`span_closing_tokens`), written after
        the output ``token_ids[start:end]``, closes a span rather than opening
        one. Does not change the constraint's grammar state, nor waits for it
        (the engine may ask while the constraint's accept runs on another
        thread); it may keep what it counted of ``token_ids`` to go on from
        there at the next call (an ``end`` below it, or a :meth:`rollback`,
        starts it again). Default: False."""
        return False


def _false(_constraint: Any) -> bool:
    return False


def _zero(_constraint: Any) -> int:
    return 0


def _none(_constraint: Any) -> None:
    return None


def _closes_no_span(_constraint: Any, _token_ids: list[int], _start: int, _end: int,
                    _token: int) -> bool:
    return False


def _overrides(kind: type, name: str) -> bool:
    """Whether ``kind`` defines ``name`` below :class:`BaseConstraint`."""
    for klass in kind.__mro__:
        if name in klass.__dict__:
            return klass is not BaseConstraint
    return False


@dataclass(frozen=True, slots=True)
class ConstraintOps:
    """The optional operations of one constraint class, resolved once.

    Batch operations are None where the class keeps :class:`BaseConstraint`'s
    default (a bare :class:`LogitsConstraint` always does): the engine then
    loops over the rows itself, so that one failing constraint fails its own
    request only. Per-instance hooks are plain functions of the constraint.
    """

    fill_bitmasks: Callable | None
    fill_distinct_bitmasks: Callable | None
    accept_tokens: Callable | None
    batch_acceptor: Callable | None
    prepare: Callable | None
    tidy: Callable | None
    forces_text: Callable[[Any], bool]
    narrow_choice: Callable[[Any], bool]
    rollback_hint: Callable[[Any], int]
    last_violation: Callable[[Any], "str | None"]  # (the attribute's value)
    take_forced_tokens: Callable[[Any, int], list[int]]
    fork: Callable[[Any], Any]
    span_closing_tokens: Callable[[Sequence[bytes]], "frozenset[int] | None"] | None
    closes_span: Callable[[Any, list[int], int, int, int], bool]


def _bare_ops() -> ConstraintOps:
    """The operations of a class that is only a :class:`LogitsConstraint`."""
    return ConstraintOps(None, None, None, None, None, None, forces_text=_false,
                         narrow_choice=_false, rollback_hint=_zero, last_violation=_none,
                         take_forced_tokens=accept_forced_tokens, fork=_none,
                         span_closing_tokens=None, closes_span=_closes_no_span)


@functools.cache
def ops_for(kind: type) -> ConstraintOps:
    """The optional operations of constraint class ``kind``, resolved once per
    class: its own for a :class:`BaseConstraint`, the defaults for a bare
    :class:`LogitsConstraint`."""
    if not issubclass(kind, BaseConstraint):
        return _bare_ops()

    def own(name: str, hook: Callable) -> Callable | None:
        return hook if _overrides(kind, name) else None

    return ConstraintOps(
        fill_bitmasks=own("fill_bitmasks", kind.fill_bitmasks),
        fill_distinct_bitmasks=own("fill_distinct_bitmasks", kind.fill_distinct_bitmasks),
        accept_tokens=own("accept_tokens", kind.accept_tokens),
        batch_acceptor=own("batch_acceptor", kind.batch_acceptor),
        prepare=own("prepare", kind.prepare), tidy=own("tidy", kind.tidy),
        forces_text=kind.forces_text, narrow_choice=kind.narrow_choice,
        rollback_hint=kind.rollback_hint, last_violation=operator.attrgetter("last_violation"),
        take_forced_tokens=kind.take_forced_tokens, fork=kind.fork,
        span_closing_tokens=own("span_closing_tokens", kind.span_closing_tokens),
        closes_span=kind.closes_span)


def take_forced_tokens(constraint: LogitsConstraint, limit: int) -> list[int]:
    """The tokens ``constraint`` fixes from here, at most ``limit``, accepted into
    it: its class's ``take_forced_tokens``, else :func:`accept_forced_tokens`."""
    return list(ops_for(type(constraint)).take_forced_tokens(constraint, limit))


def accept_forced_tokens(constraint: LogitsConstraint, limit: int) -> list[int]:
    """``constraint.forced_tokens()``, at most ``limit``, accepted one by one up to
    the first it refuses: those accepted."""
    taken: list[int] = []
    for token in constraint.forced_tokens()[:max(limit, 0)]:
        if not constraint.accept(token):
            break
        taken.append(token)
    return taken


def bitmask_words(vocab_size: int) -> int:
    """Number of int32 words of one bitmask row for ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32
