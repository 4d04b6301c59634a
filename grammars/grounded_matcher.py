"""GroundedMatcher: a JSON-Schema matcher whose grounded values come from a text.

It wraps the grammar's matcher the way :class:`~formcast.grammars.matcher.EndCheckedMatcher`
does, and follows every step with a :class:`~formcast.grammars.json_tracker.JsonTracker`.
Its mask is the grammar's AND grounding's: inside a grounded string or number the
allowed tokens come from the text's tables
(:class:`~formcast.grammars.grounding_text.GroundingText`); elsewhere only the few
tokens the grammar allows that could open a grounded value (or end a repeated array
item) are checked, one by one. With ``stop_loops``, a plain string or number whose end
repeats one unit again and again (:func:`looping`) may only end next. Where the two leave
nothing, the grammar's mask stands alone and the step is recorded in
:attr:`GroundedMatcher.violations`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from formcast.engine.constraint import ops_for
from formcast.grammars.grounding import ANY_INDEX, GroundingPlan
from formcast.grammars.grounding_source import clause_breaks
from formcast.grammars.grounding_text import GroundingText, Sensitivity, token_index
from formcast.grammars.json_tracker import (ARRAY, GROUNDED_NUMBER, GROUNDED_STRING, KEY,
                                            NUMBER, PLAIN, STRING, JsonTracker, Refusal,
                                            Repeat)
from formcast.grammars.matcher import Matcher
from formcast.grammars.vocab import Vocabulary


@dataclass(frozen=True, slots=True)
class GroundingViolation:
    """A step where grounding had to give way to the schema.

    Attributes
    ----------
    kind : str
        ``"ungrounded"``: no token the schema allowed kept the value in the text (e.g.
        a required integer and a text without numbers). ``"repeat"``: an array item
        equal to an earlier one could not end the array (the schema wants more items).
        ``"loop"``: a string that repeats itself could not close (its schema wants more).
    pointer : str
        JSON pointer of the value.
    value : str
        The value as written up to the step (``"repeat"``: the item, compact JSON).
    """

    kind: str
    pointer: str
    value: str

    @property
    def message(self) -> str:
        """The violation in words."""
        where = self.pointer or "the document"
        if self.kind == "repeat":
            return f"{where} repeats an earlier item ({self.value}) and the schema wants more"
        if self.kind == "loop":
            return f"{where} repeats itself and the schema does not let it close: {self.value!r}"
        return f"{where} is not in the text (written so far: {self.value!r})"


_NUMBER_BYTES = frozenset(b"0123456789.eE+-")


def _ids(words: np.ndarray) -> np.ndarray:
    """Token ids whose bit is set in an int32 bitmask row."""
    nz = np.flatnonzero(words)
    if not len(nz):
        return nz
    bits = np.unpackbits(words[nz].view(np.uint8), bitorder="little").reshape(-1, 32)
    rows, cols = np.nonzero(bits)
    return nz[rows] * 32 + cols


def _clear(words: np.ndarray, ids: Sequence[int]) -> None:
    """Clear the bits of ``ids`` in an int32 bitmask row, in place."""
    view = words.view(np.uint32)
    for tid in ids:
        view[tid >> 5] &= np.uint32(~(1 << (tid & 31)) & 0xFFFFFFFF)


def looping(content: bytes, *, min_repeats: int = 3, min_bytes: int = 32,
            window: int = 192) -> bool:
    """Whether ``content`` ends with one unit written ``min_repeats`` times or more in a
    row, the repeats covering ``min_bytes`` at least (units up to ``window //
    min_repeats`` bytes long). A string that does has stopped saying anything new:
    a small model under a grammar would go on until its token budget ran out."""
    tail = content[-window:]
    n = len(tail)
    for period in range(1, n // min_repeats + 1):
        need = max(min_repeats * period, min_bytes)
        if need > n:
            break
        if tail[n - need:n - period] == tail[n - need + period:]:  # (periodic over need)
            return True
    return False


def _set(words: np.ndarray, ids: Sequence[int]) -> None:
    view = words.view(np.uint32)
    for tid in ids:
        view[tid >> 5] |= np.uint32(1 << (tid & 31))


class GroundedMatcher(Matcher):
    """A JSON-Schema matcher whose grounded values stay in a source text.

    Made by :func:`~formcast.grammars.grounding.ground` or
    ``CompiledGrammar.grounded_matcher``. ``rollback`` counts steps as the wrapped
    matcher does.
    """

    __slots__ = ("_inner", "_inner_fill", "_text", "_plan", "_vocab", "_distinct", "_active",
                 "_tracker", "_history", "_violations", "_token_bytes", "_eos", "_version",
                 "_free_version", "_stop_loops", "_items")

    def __init__(self, inner: Matcher, text: str | GroundingText, plan: GroundingPlan,
                 vocab: Vocabulary, *, distinct_items: bool = False,
                 stop_loops: bool = False, items: GroundingText | None = None) -> None:
        self._inner = inner
        self._inner_fill = inner.fill_bitmask           # bound once: the hot path
        if not isinstance(text, GroundingText):
            source = text

            def tables(breaks: frozenset[int]) -> GroundingText:
                return token_index(vocab).grounding_text(
                    source, strings=bool(plan.strings), numbers=bool(plan.numbers),
                    distinct=distinct_items, words=plan.words, capitalise=plan.capitalise,
                    breaks=breaks)
            text = tables(clause_breaks(source) if plan.clauses else frozenset())
            # (a list item also ends at "and"/"or": its own tables, where it has any)
            if plan.clauses and any(p and p[-1] == ANY_INDEX for p in plan.strings):
                items = tables(clause_breaks(source, items=True))
        self._text = text
        self._items = text if items is None else items
        self._plan = plan
        self._vocab = vocab
        self._distinct = distinct_items
        self._stop_loops = stop_loops
        self._active = bool(plan) or distinct_items or stop_loops
        self._tracker = JsonTracker(plan.tree, distinct_items)
        self._history: list[tuple[tuple, tuple]] = []   # (tracker snapshot, violations) a step
        self._violations: tuple[GroundingViolation, ...] = ()
        self._token_bytes = vocab.token_bytes
        self._eos = vocab.eos_token_ids
        self._version = 0            # bumped by every change of state
        self._free_version = -1      # the version whose grounded mask was empty

    # -- what it found ------------------------------------------------------------

    @property
    def violations(self) -> tuple[GroundingViolation, ...]:
        """Steps where grounding gave way to the schema, oldest first (kept in step
        with rollback)."""
        return self._violations

    @property
    def repeats(self) -> tuple[Repeat, ...]:
        """Arrays that ended on an item equal to an earlier sibling (with
        ``distinct_items``): the pointer and value of each such last item."""
        return self._tracker.repeats

    @property
    def source_text(self) -> str:
        """The text grounded values come from."""
        return self._text.text

    @property
    def plan(self) -> GroundingPlan:
        return self._plan

    @property
    def inner(self) -> Matcher:
        """The wrapped schema matcher."""
        return self._inner

    # -- the mask ---------------------------------------------------------------

    def _token_ok(self, tid: int) -> bool:
        """Whether grounding takes token ``tid`` here (state unchanged)."""
        tracker = self._tracker
        snap = tracker.snapshot()
        refusal = tracker.feed(self._token_bytes[tid], self._here())
        tracker.restore(snap)
        return refusal is None

    def _here(self) -> GroundingText:
        """The tables of the value written here: a list item's, or any other's."""
        stack = self._tracker.stack
        return self._items if stack and stack[-1][0] == ARRAY else self._text

    def _restrict(self, row: np.ndarray) -> bool:
        """AND grounding into the grammar's mask ``row`` (int32 words, in place); False
        (``row`` unchanged) when that would leave no token."""
        tracker, text = self._tracker, self._here()
        if tracker.done:
            return True
        # (a "," can end a repeated item only inside an array)
        sens = text.sensitivities[self._distinct and tracker.in_array()]
        if self._in_loop():  # (only what ends the value, and what grounding takes after it)
            closing = row & (text.index.quote_opening_words if tracker.mode == STRING
                             else sens.ending_words | sens.ending_check_words)
            new = self._outside(closing, sens)
            new = closing if new is None else new
            if not new.any():
                return False
            row[:] = new
            return True
        mode = tracker.mode
        if mode == STRING and tracker.vkind == GROUNDED_STRING:
            new = self._inside(row, *text.string_mask(tracker.buf, sens))
        elif mode == NUMBER and tracker.vkind == GROUNDED_NUMBER:
            new = self._inside(row, *text.number_mask(tracker.buf, sens, tracker.integer))
        else:
            new = self._outside(row, sens)
            if new is None:
                return True
        if not new.any():
            return False
        row[:] = new
        return True

    def _inside(self, row: np.ndarray, allowed: np.ndarray, check: np.ndarray | None
                ) -> np.ndarray:
        """``row`` AND a grounded value's mask (``allowed``, and those of ``check``
        that pass one by one)."""
        new = row & allowed
        if check is not None:
            _set(new, [t for t in _ids(row & check).tolist() if self._token_ok(t)])
        return new

    def _outside(self, row: np.ndarray, sens: Sensitivity) -> np.ndarray | None:
        """``row`` less the tokens that would break grounding, outside grounded values:
        only the few that could enter one (or end a repeated item) are checked. None:
        nothing to take out."""
        tracker = self._tracker
        ids, words, shifts = sens.closing if tracker.mode in (STRING, KEY) and \
            tracker.esc == 0 else sens.any
        ids = ids[(row.view(np.uint32)[words] >> shifts) & 1 != 0]
        if not len(ids):
            return None
        node = tracker.value_node()
        if node is None or not node.number:
            bad = [t for t in ids.tolist() if not self._token_ok(t)]
            if not bad:
                return None
            new = row.copy()
            _clear(new, bad)
            return new
        # a grounded number starts here: its first token is judged as its next one
        opening = self._text.index.number_opening_words
        starts = self._inside(row & opening, *self._text.number_mask(b"", sens, node.integer))
        view = opening.view(np.uint32)
        ids = ids[(view[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1 == 0]
        new = row & ~opening
        _clear(new, [t for t in ids.tolist() if not self._token_ok(t)])
        return new | starts

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._inner_fill(bitmask, row)
        if self._active and not self._restrict(bitmask.numpy()[row]):
            self._free_version = self._version

    @classmethod
    def fill_bitmasks(cls, constraints: list, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Many rows in one call (the engine's optional batch hook): the wrapped
        matchers' rows by their own class's batch fill where they share one, then
        grounding row by row."""
        rows = list(rows)
        inners = [c._inner for c in constraints]
        kinds = {type(m) for m in inners}
        many = ops_for(kinds.pop()).fill_bitmasks if len(kinds) == 1 else None
        if many is not None:
            many(inners, bitmask, rows)
        else:
            for inner, row in zip(inners, rows):
                inner.fill_bitmask(bitmask, row)
        array = bitmask.numpy()
        for c, row in zip(constraints, rows):
            if c._active and not c._restrict(array[row]):
                c._free_version = c._version

    @classmethod
    def prepare(cls, constraints: list) -> None:
        """Ready the wrapped matchers for their first step (the engine's optional
        hook, offered while the device runs their prefill): their own class's."""
        by_kind: dict[type, list[Matcher]] = {}
        for c in constraints:
            by_kind.setdefault(type(c._inner), []).append(c._inner)
        for kind, inners in by_kind.items():
            ready = ops_for(kind).prepare
            if ready is not None:
                ready(inners)

    def _in_loop(self) -> bool:
        """Whether the next token must end a plain string or number that repeats itself."""
        tracker = self._tracker
        return (self._stop_loops and (tracker.mode == STRING or tracker.mode == NUMBER)
                and tracker.esc == 0 and tracker.vkind == PLAIN and looping(tracker.buf))

    def _ends_value(self, data: bytes) -> bool:
        """Whether ``data`` starts by ending the string or number being written."""
        if self._tracker.mode == STRING:
            return data[0] == 34   # '"'
        return data[0] not in _NUMBER_BYTES

    def _grounding_empty(self) -> bool:
        """Whether grounding leaves no token the grammar allows here."""
        if self._free_version != self._version:
            scratch = torch.zeros(1, self._vocab.bitmask_words, dtype=torch.int32)
            self.fill_bitmask(scratch, 0)
        return self._free_version == self._version

    # -- steps ------------------------------------------------------------------

    def _step(self, data: bytes, take) -> bool:
        """Take ``data`` into the tracker and ``take()`` into the grammar, or neither."""
        tracker = self._tracker
        snap = (tracker.snapshot(), self._violations)
        refusal: Refusal | None = None
        if self._active and self._in_loop() and not self._ends_value(data):
            refusal = Refusal("loop", tracker.pointer(), tracker.buf[-64:].decode("utf-8",
                                                                                "replace"))
            if not self._grounding_empty():
                return False
        elif self._active:
            refusal = tracker.feed(data, self._here())
            if refusal is not None:
                tracker.restore(snap[0])
                if not self._grounding_empty():
                    return False
        if not take():
            tracker.restore(snap[0])
            return False
        if refusal is not None:      # the grammar's mask stood alone: follow, unchecked
            tracker.feed(data, None)
            tracker.release_value()
            self._violations += (GroundingViolation(refusal.kind, refusal.pointer,
                                                    refusal.value),)
        self._history.append(snap)
        self._version += 1
        return True

    def accept(self, token_id: int) -> bool:
        if token_id in self._eos:
            refusal = self._tracker.finish(self._here()) if self._active else None
            if refusal is not None and not self._grounding_empty():
                return False
            if not self._inner.accept(token_id):
                return False
            self._history.append((self._tracker.snapshot(), self._violations))
            self._version += 1
            return True
        data = self._token_bytes[token_id] if 0 <= token_id < len(self._token_bytes) else b""
        if not data:
            return False
        return self._step(data, lambda: self._inner.accept(token_id))

    def accept_text(self, text: str) -> bool:
        return self._step(text.encode("utf-8"), lambda: self._inner.accept_text(text))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens < 0 or num_tokens > len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} steps; only "
                             f"{len(self._history)} taken")
        if not num_tokens:
            return
        self._inner.rollback(num_tokens)
        snap, self._violations = self._history[-num_tokens]
        del self._history[-num_tokens:]
        self._tracker.restore(snap)
        self._version += 1
        self._restart_spans()

    def _span_counter(self):
        """The wrapped matcher's (JSON strings for a JSON Schema's)."""
        return self._inner._span_counter()

    def is_terminated(self) -> bool:
        return self._inner.is_terminated()

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def forced_tokens(self) -> list[int]:
        """The grammar's forced tokens, cut before the first grounding refuses."""
        forced = self._inner.forced_tokens()
        if not self._active or not forced:
            return forced
        tracker = self._tracker
        snap = tracker.snapshot()
        kept: list[int] = []
        for tid in forced:
            data = self._token_bytes[tid] if 0 <= tid < len(self._token_bytes) else b""
            if not data or tracker.feed(data, self._here()) is not None:
                break
            kept.append(tid)
        tracker.restore(snap)
        return kept

    def take_forced_tokens(self, limit: int) -> list[int]:
        """A fresh matcher lets the grammar's matcher take its opening (its own
        shortcut kept), then checks it; otherwise as :meth:`Matcher.take_forced_tokens`."""
        if self._history or not self._inner._is_fresh():
            return super().take_forced_tokens(limit)
        taken = self._inner.take_forced_tokens(limit)
        tracker = self._tracker
        for k, tid in enumerate(taken):
            snap = (tracker.snapshot(), self._violations)
            data = self._token_bytes[tid] if 0 <= tid < len(self._token_bytes) else b""
            if not data or (self._active and tracker.feed(data, self._here()) is not None):
                tracker.restore(snap[0])
                self._inner.rollback(len(taken) - k)
                taken = taken[:k]
                break
            self._history.append(snap)
        self._version += 1
        return taken

    def fork(self) -> GroundedMatcher:
        other = GroundedMatcher(self._inner.fork(), self._text, self._plan, self._vocab,
                                distinct_items=self._distinct, stop_loops=self._stop_loops,
                                items=self._items)
        other._tracker = self._tracker.copy()
        other._history = list(self._history)
        other._violations = self._violations
        return other

    # -- hooks ------------------------------------------------------------------

    def forces_text(self) -> bool:
        return self._inner.forces_text()

    def narrow_choice(self) -> bool:
        """True inside a grounded value (the text leaves few tokens), else the grammar's."""
        return self._tracker.in_grounded_value() or self._inner.narrow_choice()

    def rollback_hint(self) -> int:
        return self._inner.rollback_hint()

    @property
    def last_violation(self) -> str | None:
        """The wrapped matcher's end-check verdict (grounding's are in :attr:`violations`)."""
        return self._inner.last_violation

    def _is_fresh(self) -> bool:
        return not self._history and self._inner._is_fresh()

    def __reduce__(self):
        if not self._is_fresh():
            raise TypeError("only a fresh matcher (no token accepted yet) can be sent to "
                            "another process")
        return (_rebuild, (self._inner, self._text.text, self._plan, self._vocab,
                           self._distinct, self._stop_loops))


def _rebuild(inner: Matcher, text: str, plan: GroundingPlan, vocab: Vocabulary,
             distinct: bool, stop_loops: bool = False) -> GroundedMatcher:
    return GroundedMatcher(inner, text, plan, vocab, distinct_items=distinct,
                           stop_loops=stop_loops)
