"""Apply packed token bitmasks to logits, in place.

Bitmask rows are int32 words, ``ceil(V/32)`` a row; bit ``t % 32`` of word
``t // 32`` set means token ``t`` is allowed. Columns of the logits past the
mask's width (a model vocabulary padded beyond the tokenizer's) are disallowed.
"""

from __future__ import annotations

import sys

import torch

from formcast.engine.kernels import triton_available


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 ``[N, W]`` -> bool ``[N, vocab_size]`` (True = allowed)."""
    n = bitmask.shape[0]
    if sys.byteorder == "little" and bitmask.is_contiguous():
        # bit b of byte k is token 8k + b (a word's low byte first): the bits
        # unpacked from bytes, a quarter of the work and memory of 32-bit words
        data = bitmask.view(torch.uint8)
    else:
        data = bitmask
    shifts = torch.arange(8 * data.element_size(), dtype=data.dtype, device=data.device)
    allowed = ((data.unsqueeze(-1) >> shifts) & 1).view(n, -1).bool()
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    pad = allowed.new_zeros(n, vocab_size - allowed.shape[1])
    return torch.cat([allowed, pad], dim=1)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor,
                         rows: torch.Tensor | None = None, *, backend: str = "auto") -> None:
    """Set disallowed logits to -inf in place.

    Parameters
    ----------
    logits : torch.Tensor
        ``[B, V]`` float logits; modified in place.
    bitmask : torch.Tensor
        int32 ``[N, W]``; row ``i`` applies to logits row ``rows[i]`` (or ``i``).
    rows : torch.Tensor | None
        ``[N]`` long row indices into ``logits``; None means rows ``0..N-1``.
    backend : str
        "auto" (Triton for CUDA logits, torch otherwise), "torch" or "triton".
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown bitmask backend {backend!r}: use 'auto', 'torch' or 'triton'")
    if bitmask.numel() == 0:
        return
    if backend == "triton" or (backend == "auto" and logits.is_cuda and triton_available()):
        from formcast.engine.kernels.bitmask_triton import apply_token_bitmask_triton_

        apply_token_bitmask_triton_(logits, bitmask, rows)
        return
    allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), logits.shape[1])
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        rows = rows.to(logits.device)
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def masked_argmax_(out: torch.Tensor, logits: torch.Tensor, bitmask: torch.Tensor,
                   rows: torch.Tensor, cols: torch.Tensor, agree: torch.Tensor, *,
                   vocab_size: int, mask_rows: torch.Tensor | None = None,
                   pinned: bool = False, source: torch.Tensor | None = None,
                   backend: str = "auto", few_masks: int = 8, few_allowed: int = 16) -> None:
    """Greedy picks under bitmasks, written into ``out`` in place; ``logits`` are
    left as they are.

    For each ``i``: the first maximum of ``logits[rows[i], :vocab_size]`` over the
    tokens bitmask row ``i`` (or ``mask_rows[i]``) allows goes to ``out[0, cols[i]]``, whether there is
    none (a dead end; the token is then 0) to ``out[1, cols[i]]``, and whether the
    pick equals the token ``out[0, cols[i]]`` held before (the row's unmasked
    argmax, where ``out`` holds those) to ``agree[i]``. This is what applying the
    masks and taking each row's max gives, without a pass that writes the logits.

    Parameters
    ----------
    out : torch.Tensor
        long ``[2, B]``, each row contiguous (a graph's output may be a column slice).
    logits : torch.Tensor
        float ``[R, V]``, rows contiguous.
    bitmask : torch.Tensor
        int32 ``[M, W]`` (may be on the host: copied without waiting).
    rows, cols : torch.Tensor
        long ``[N]`` on the logits' device.
    agree : torch.Tensor
        bool ``[N]``.
    vocab_size : int
        Columns that may be picked (at most ``V``); ids past the mask's width never are.
    mask_rows : torch.Tensor | None
        long ``[N]`` on the logits' device: the bitmask row of pick ``i`` (rows
        in the same grammar state share one); None: row ``i`` (then ``M == N``).
    pinned : bool
        CUDA logits: ``bitmask``, ``rows``, ``cols`` and ``mask_rows`` may lie in
        pinned host memory, which the Triton kernel reads in place (unified
        addressing), with no copy to launch (for a few rows' picks, half the
        host's time of the two copies).
    source : torch.Tensor | None
        long ``[2, B]``: the picks ``out`` starts from, ``out`` then written
        whole (its other columns ``source``'s) rather than in place, and
        ``agree`` compared with ``source``: on CUDA one launch rather than a copy
        and the picks (a step's few masked rows over the graph's unmasked picks).
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown bitmask backend {backend!r}: use 'auto', 'torch' or 'triton'")
    if source is not None and source.shape != out.shape:
        raise ValueError(f"masked argmax: source of shape {tuple(source.shape)} for out of "
                         f"{tuple(out.shape)}")
    vocab_size = min(vocab_size, logits.shape[1])
    if rows.numel() == 0:
        if source is not None:
            out.copy_(source)
        return
    if backend == "triton" or (backend == "auto" and logits.is_cuda and triton_available()):
        from formcast.engine.kernels.bitmask_triton import masked_argmax_triton_

        masked_argmax_triton_(out, logits, bitmask, rows, cols, agree, vocab_size, mask_rows,
                              pinned=pinned, source=source)
        return
    if source is not None:
        out.copy_(source)
    bitmask = bitmask.to(logits.device, non_blocking=True)
    if logits.device.type == "cpu" and (mask_rows is not None or rows.numel() <= few_masks):
        _masked_argmax_by_mask(out, logits, bitmask, rows, cols, agree, vocab_size, mask_rows,
                               few_allowed)
        return
    x = logits[rows, :vocab_size].float()
    if mask_rows is not None:
        bitmask = bitmask[mask_rows]
    allowed = unpack_bitmask(bitmask, vocab_size)
    values, ids = x.masked_fill_(~allowed, float("-inf")).max(dim=-1)
    agree.copy_(ids == out[0, cols])
    out[0, cols] = ids
    out[1, cols] = torch.isneginf(values).long()



def _masked_argmax_by_mask(out: torch.Tensor, logits: torch.Tensor, bitmask: torch.Tensor,
                           rows: torch.Tensor, cols: torch.Tensor, agree: torch.Tensor,
                           vocab_size: int, mask_rows: torch.Tensor | None,
                           few_allowed: int) -> None:
    """:func:`masked_argmax_` on the CPU, a mask row at a time: each mask row
    is unpacked once for every pick that reads it (rows in one grammar state
    share one), and where it allows few tokens (forced text, a key) only their
    logits are read; else the picks' rows keep their own argmax where the
    mask allows it, and only the others are masked (rather than every row's
    mask unpacked and every logit masked: many times slower)."""
    used = range(bitmask.shape[0]) if mask_rows is None else mask_rows.unique().tolist()
    allowed = unpack_bitmask(bitmask, vocab_size)
    ids = torch.zeros(rows.numel(), dtype=torch.long)
    dead = torch.zeros(rows.numel(), dtype=torch.bool)
    for m in used:
        at = torch.tensor([m]) if mask_rows is None else (mask_rows == m).nonzero()[:, 0]
        picks = rows[at]
        tokens = allowed[m].nonzero()[:, 0]
        if tokens.numel() == 0:  # a dead end: token 0, flagged
            dead[at] = True
            continue
        if tokens.numel() * few_allowed <= vocab_size:
            values, best = logits[picks.unsqueeze(1), tokens].float().max(dim=-1)
            best = tokens[best]
        else:  # (most rows' own argmax is allowed: only the others are masked)
            x = logits[picks, :vocab_size].float()
            values, best = x.max(dim=-1)
            off = (~allowed[m][best]).nonzero()[:, 0]
            if off.numel():
                values[off], best[off] = x[off].masked_fill_(~allowed[m], float("-inf")
                                                             ).max(dim=-1)
        none = torch.isneginf(values)  # (every allowed logit -inf: token 0, as a dead end)
        ids[at] = best.masked_fill_(none, 0)
        dead[at] = none
    agree.copy_(ids == out[0, cols])
    out[0, cols] = ids
    out[1, cols] = dead.long()
