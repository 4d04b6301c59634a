"""Token bitmasks: allocate, fill for a whole batch, apply to logits on their device.

Bitmask rows are int32 words, ``ceil(vocab_size/32)`` a row; bit ``t % 32`` of word
``t // 32`` set means token ``t`` is allowed (the engine's layout). Masks are filled
on the CPU and applied once, in place, where the logits live: the engine's torch
kernel on the CPU, a Triton kernel on CUDA when one is available.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from formcast.engine.constraint import bitmask_words
from formcast.engine.kernels.bitmask import apply_token_bitmask_
from formcast.grammars.matcher import Matcher

_BACKENDS = ("auto", "torch", "triton")


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
    from formcast.grammars.backends.xgrammar_backend import XGrammarMatcher, batch_fill

    plain = [(m, r) for m, r in zip(matchers, rows) if type(m) is XGrammarMatcher]
    if len(plain) > 1:
        batch_fill([m for m, _ in plain], bitmask, [r for _, r in plain])
    else:
        plain = []
    done = {id(m) for m, _ in plain}
    for m, r in zip(matchers, rows):
        if id(m) not in done:
            m.fill_bitmask(bitmask, r)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                  rows: torch.Tensor | Sequence[int] | None = None, *,
                  backend: str = "auto") -> None:
    """Set the logits of disallowed tokens to -inf, in place.

    Parameters
    ----------
    logits : torch.Tensor
        ``[B, V]`` float logits on any device; modified in place. Columns past the
        mask's width (padded vocabularies) are disallowed.
    bitmask : torch.Tensor
        int32 ``[N, ceil(V/32)]``; row ``i`` applies to logits row ``rows[i]``.
    rows : tensor or sequence of int or None
        Logits row of each mask row; None means ``0..N-1``. Rows not listed are left
        untouched.
    backend : {"auto", "torch", "triton"}
        "auto": Triton for CUDA logits when Triton is usable, else torch.

    Raises
    ------
    ValueError
        Unknown backend, or "triton" asked for logits not on a CUDA device.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"unknown bitmask backend {backend!r}; choose from {_BACKENDS}")
    if rows is not None and not isinstance(rows, torch.Tensor):
        rows = torch.tensor(list(rows), dtype=torch.long)
    use_triton = backend == "triton" or (backend == "auto" and logits.is_cuda
                                         and _triton_usable())
    if use_triton:
        if not logits.is_cuda:
            raise ValueError("the triton bitmask kernel needs CUDA logits")
        from formcast.engine.kernels.bitmask_triton import apply_token_bitmask_triton_
        apply_token_bitmask_triton_(logits, bitmask, rows)
        return
    apply_token_bitmask_(logits, bitmask, rows)


def _triton_usable() -> bool:
    try:
        import formcast.engine.kernels.bitmask_triton  # noqa: F401
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
