"""Token bitmasks: allocate, and fill for a whole batch.

Bitmask rows are int32 words, ``ceil(vocab_size/32)`` a row; bit ``t % 32`` of word
``t // 32`` set means token ``t`` is allowed (the engine's layout). The grammar layer
fills masks on the CPU; the engine applies them, in place, where the logits live.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from formcast.engine.constraint import bitmask_words
from formcast.grammars.matcher import Matcher


def allocate_bitmask(rows: int, vocab_size: int, *, pin_memory: bool = False) -> torch.Tensor:
    """An int32 ``[rows, ceil(vocab_size/32)]`` CPU bitmask with every token allowed.

    Parameters
    ----------
    rows : int
        One row per constrained sequence.
    vocab_size : int
        The logits width.
    pin_memory : bool
        Page-lock it, for asynchronous copies to a GPU.
    """
    if rows < 0 or vocab_size <= 0:
        raise ValueError(f"need rows >= 0 and vocab_size > 0, got {rows} and {vocab_size}")
    mask = torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)
    return mask.pin_memory() if pin_memory else mask


def fill_bitmasks(matchers: Sequence[Matcher], bitmask: torch.Tensor,
                  rows: Sequence[int] | None = None) -> None:
    """Fill the rows of a whole batch in one call. Changes only ``bitmask``.

    xgrammar matchers are filled together by xgrammar's batch matcher (worker
    threads, GIL released); any others one by one.

    Parameters
    ----------
    matchers : sequence of Matcher
    bitmask : torch.Tensor
        int32 ``[N, W]`` CPU tensor.
    rows : sequence of int or None
        Row of each matcher (default ``0..len(matchers)-1``).
    """
    rows = list(range(len(matchers))) if rows is None else list(rows)
    if len(rows) != len(matchers):
        raise ValueError(f"{len(matchers)} matchers but {len(rows)} rows")
    from formcast.grammars.backends.xgrammar.batch_fill import batch_fill
    from formcast.grammars.backends.xgrammar.matcher import XGrammarMatcher

    plain = [(m, r) for m, r in zip(matchers, rows) if type(m) is XGrammarMatcher]
    if len(plain) > 1:
        batch_fill([m for m, _ in plain], bitmask, [r for _, r in plain])
    else:
        plain = []
    done = {id(m) for m, _ in plain}
    for m, r in zip(matchers, rows):
        if id(m) not in done:
            m.fill_bitmask(bitmask, r)
