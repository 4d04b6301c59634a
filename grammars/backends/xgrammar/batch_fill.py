"""Filling many xgrammar matchers' mask rows at once, one fill per shared state."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import torch

from formcast.grammars.backends.xgrammar.batch_accept import TEXT, all_alike
from formcast.grammars.backends.xgrammar.worker_jobs import any_broken, settle_rows

if TYPE_CHECKING:
    from formcast.grammars.backends.xgrammar.matcher import XGrammarMatcher

_ORIGIN = operator.attrgetter("_origin")


def batch_fill(matchers: list[XGrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
    """Fill the rows of several xgrammar matchers in one call (GIL released).
    Changes only ``bitmask`` (and the grammars' known masks).

    Matchers of one grammar that took the same text are in the same state: one
    of them is filled and the others' rows are copies of its row. That is the
    opening of a batch of answers to one schema, where every row is masked and
    the grammar forces the text ('{"records":[{"name":"'): the rows' tokens
    differ, their texts mostly do not. The engine reads such rows shared
    instead (:func:`fill_distinct`)."""
    fill, index = (matchers, None) if len(rows) <= 1 else distinct_states(matchers)
    if index is None:
        fill_states(matchers, bitmask, rows)
        return
    fill_rows = [-1] * len(fill)
    for row, at in zip(rows, index):
        if fill_rows[at] < 0:
            fill_rows[at] = row
    fill_states(fill, bitmask, fill_rows)
    # each filled row broadcast to its copies through numpy: no gathered
    # temporary, and cheaper than torch's row copy
    words = bitmask.numpy()
    for row, at in zip(rows, index):
        if row != fill_rows[at]:
            words[row] = words[fill_rows[at]]


def fill_distinct(matchers: list[XGrammarMatcher], bitmask: torch.Tensor) -> list[int] | None:
    """Fill one row of ``bitmask`` per state among ``matchers``, rows ``0..k-1``,
    in one call; the row that holds each matcher's mask, or None when each has
    its own (row ``i``: matcher ``i``'s). At a batch's opening this fills a few
    rows where :func:`batch_fill` also copies the others, and the device reads
    fewer rows."""
    fill, index = distinct_states(matchers) if len(matchers) > 1 else (matchers, None)
    fill_states(fill, bitmask, list(range(len(fill))))
    return index


def fill_states(matchers: list[XGrammarMatcher], bitmask: torch.Tensor, rows: list[int]
                ) -> None:
    """Fill ``bitmask[rows[k]]`` with ``matchers[k]``'s mask: a copy of its text's
    known mask when there is one (see :class:`~.text_masks.TextMasks`), else
    xgrammar's fill, once the worker took the matchers' tokens; the masks
    xgrammar filled for kept texts become known. Raises when a matcher is
    broken (see :class:`~.worker_jobs.PendingAccept`)."""
    if not matchers:
        return
    tuning = matchers[0]._tuning
    words = bitmask.numpy() if bitmask.device.type == "cpu" else None
    if words is not None and tuning.text_masks:
        width, left, left_rows = bitmask.shape[1], [], []
        for m, row in zip(matchers, rows):
            known = m._known_mask(width)
            if known is None:
                left.append(m)
                left_rows.append(row)
            else:
                words[row] = known
        if not left:
            return
        matchers, rows = left, left_rows
    settle_rows(matchers)
    if any_broken(matchers):
        for m in matchers:
            if m._broken is not None:
                raise RuntimeError(m._broken)
    plan = matchers[0]._origin.backend.fill_plans.get()
    plan.fill([m._m for m in matchers], bitmask, rows)
    if words is not None and tuning.text_masks:
        for m, row in zip(matchers, rows):
            if m._text is not None:
                m._origin.text_masks.add(m._text, words[row])


def distinct_states(matchers: list[XGrammarMatcher]
                    ) -> tuple[list[XGrammarMatcher], list[int] | None]:
    """The matchers to fill, one per state known shared (the same grammar and
    text), and each matcher's place among them; None when every matcher is its
    own (the matchers to fill are then ``matchers``)."""
    first: dict = {}
    texts = list(map(TEXT, matchers))
    if None not in texts and len(set(map(_ORIGIN, matchers))) == 1:
        # (the usual batch, one grammar's matchers that all keep their texts:
        # grouped by text alone, in C-level loops)
        if all_alike(texts):  # (rows in step: one text)
            return matchers[:1], [0] * len(texts)
        index = [first.setdefault(text, len(first)) for text in texts]
        if len(first) == len(matchers):
            return matchers, None
        return [matchers[texts.index(text)] for text in first], index
    keep: list[XGrammarMatcher] = []
    index = []
    for m in matchers:
        text = m._text
        if text is not None:
            key = (m._origin, text)
            at = first.get(key)
            if at is None:
                at = first[key] = len(keep)
                keep.append(m)
        else:
            at = len(keep)
            keep.append(m)
        index.append(at)
    if len(keep) == len(matchers):
        return matchers, None
    return keep, index
