"""Triton kernel: set disallowed logits to -inf from packed bitmasks (CUDA).

One program per (mask row, block of vocabulary). Only disallowed entries are
written, logits are never read, and rows without a constraint are skipped by
index, so the cost is one pass over the constrained rows' masks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from formcast.engine.kernels.triton_launch import FastLaunch

BLOCK = 4096


@triton.jit
def _apply_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, vocab_size, num_words,
                          logits_stride, bitmask_stride, BLOCK_SIZE: tl.constexpr):
    mask_row = tl.program_id(0)
    block = tl.program_id(1)
    row = tl.load(rows_ptr + mask_row).to(tl.int64)
    offs = block * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    in_vocab = offs < vocab_size
    word = offs // 32
    words = tl.load(bitmask_ptr + mask_row * bitmask_stride + word,
                    mask=in_vocab & (word < num_words), other=0)
    allowed = ((words >> (offs % 32)) & 1) != 0
    tl.store(logits_ptr + row * logits_stride + offs, float("-inf"), mask=in_vocab & ~allowed)


def apply_token_bitmask_triton_(logits: torch.Tensor, bitmask: torch.Tensor,
                                rows: torch.Tensor | None = None) -> None:
    """In place on CUDA: logits [B, V] (any float dtype), bitmask int32 [N, W], rows [N]."""
    n = bitmask.shape[0]
    if rows is None:
        rows = torch.arange(n, device=logits.device)
    rows = rows.to(device=logits.device, dtype=torch.int64)
    bitmask = bitmask.to(logits.device, non_blocking=True)
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("logits and bitmask rows must be contiguous")
    vocab = logits.shape[1]
    grid = (n, triton.cdiv(vocab, BLOCK))
    _apply_bitmask_kernel[grid](logits, bitmask, rows, vocab, bitmask.shape[1],
                                logits.stride(0), bitmask.stride(0), BLOCK_SIZE=BLOCK)


# 8192 ids a pass, 8 warps: fewer, wider passes (a row's passes run one after another)
ARGMAX_BLOCK = 8192
ARGMAX_WARPS = 8


@triton.jit
def fold_first_max(x, offs, best, best_idx, none):
    """A block of values ``x`` at ids ``offs`` folded into a running first
    maximum ``best`` at ``best_idx``: returns the new pair (``none``: an id
    past every one of ``offs``)."""
    m = tl.max(x, axis=0)
    first = tl.min(tl.where(x == m, offs, none), axis=0)  # the first id of the max
    take = m > best  # strictly: an earlier block keeps a tie
    return tl.where(take, m, best), tl.where(take, first, best_idx)


@triton.jit
def _copy_unpicked(out_ptr, out_stride, src_ptr, src_stride, cols_ptr, n_picks, n_cols,
                   block, COPY_BLOCK: tl.constexpr, SCAN: tl.constexpr):
    """Columns ``block`` of ``src`` [2, n_cols] into ``out``, but those among the
    ``n_picks`` picked columns ``cols`` (their programs write them)."""
    c = block * COPY_BLOCK + tl.arange(0, COPY_BLOCK)
    picked = c < 0
    for start in range(0, n_picks, SCAN):
        k = start + tl.arange(0, SCAN)
        at = tl.load(cols_ptr + k, mask=k < n_picks, other=-1)
        picked = picked | (tl.max((c[:, None] == at[None, :]).to(tl.int32), axis=1) > 0)
    keep = (c < n_cols) & ~picked
    tl.store(out_ptr + c, tl.load(src_ptr + c, mask=keep), mask=keep)
    tl.store(out_ptr + out_stride + c, tl.load(src_ptr + src_stride + c, mask=keep), mask=keep)


@triton.jit
def _masked_argmax_kernel(logits_ptr, logits_stride, rows_ptr, bitmask_ptr, bitmask_stride,
                          num_words, vocab_size, out_ptr, out_stride, cols_ptr, agree_ptr,
                          mask_rows_ptr, src_ptr, src_stride, n_picks, n_cols,
                          BLOCK_SIZE: tl.constexpr, SHARED: tl.constexpr, COPY: tl.constexpr,
                          COPY_BLOCK: tl.constexpr, SCAN: tl.constexpr):
    i = tl.program_id(0)
    if COPY:
        if i >= n_picks:  # (the programs past the picks copy the other columns)
            _copy_unpicked(out_ptr, out_stride, src_ptr, src_stride, cols_ptr, n_picks, n_cols,
                           i - n_picks, COPY_BLOCK, SCAN)
        else:
            _masked_pick(logits_ptr, logits_stride, rows_ptr, bitmask_ptr, bitmask_stride,
                         num_words, vocab_size, out_ptr, out_stride, cols_ptr, agree_ptr,
                         mask_rows_ptr, src_ptr, i, BLOCK_SIZE, SHARED)
    else:
        _masked_pick(logits_ptr, logits_stride, rows_ptr, bitmask_ptr, bitmask_stride,
                     num_words, vocab_size, out_ptr, out_stride, cols_ptr, agree_ptr,
                     mask_rows_ptr, out_ptr, i, BLOCK_SIZE, SHARED)


@triton.jit
def _masked_pick(logits_ptr, logits_stride, rows_ptr, bitmask_ptr, bitmask_stride,
                 num_words, vocab_size, out_ptr, out_stride, cols_ptr, agree_ptr,
                 mask_rows_ptr, before_ptr, i, BLOCK_SIZE: tl.constexpr, SHARED: tl.constexpr):
    """Pick ``i``: its masked argmax into ``out[:, cols[i]]``, and whether it is
    the token ``before_ptr[cols[i]]`` into ``agree[i]``."""
    row = tl.load(rows_ptr + i).to(tl.int64)
    col = tl.load(cols_ptr + i).to(tl.int64)
    if SHARED:  # rows in one grammar state read one mask row
        mask_row = tl.load(mask_rows_ptr + i).to(tl.int64)
    else:
        mask_row = i.to(tl.int64)
    best = float("-inf")
    best_idx = 0
    for start in range(0, vocab_size, BLOCK_SIZE):
        offs = start + tl.arange(0, BLOCK_SIZE)
        in_vocab = offs < vocab_size
        word = offs // 32
        words = tl.load(bitmask_ptr + mask_row * bitmask_stride + word,
                        mask=in_vocab & (word < num_words), other=0)
        allowed = ((words >> (offs % 32)) & 1) != 0
        x = tl.load(logits_ptr + row * logits_stride + offs, mask=in_vocab & allowed,
                    other=float("-inf")).to(tl.float32)
        best, best_idx = fold_first_max(x, offs, best, best_idx, vocab_size)
    before = tl.load(before_ptr + col)
    tl.store(out_ptr + col, best_idx.to(tl.int64))
    tl.store(out_ptr + out_stride + col, (best == float("-inf")).to(tl.int64))
    tl.store(agree_ptr + i, best_idx.to(tl.int64) == before)


def masked_argmax_triton_(out: torch.Tensor, logits: torch.Tensor, bitmask: torch.Tensor,
                          rows: torch.Tensor, cols: torch.Tensor, agree: torch.Tensor,
                          vocab_size: int, mask_rows: torch.Tensor | None = None, *,
                          pinned: bool = False, source: torch.Tensor | None = None) -> None:
    """See :func:`formcast.engine.kernels.bitmask.masked_argmax_` (CUDA tensors;
    with ``pinned``, the masks and index tensors may be in pinned host memory)."""
    n = rows.shape[0]
    if not pinned:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    if logits.stride(1) != 1 or bitmask.stride(1) != 1 or out.stride(1) != 1 or \
            (source is not None and source.stride(1) != 1):
        raise ValueError("logits, bitmask, out and source rows must be contiguous")
    shared = mask_rows is not None
    copy = source is not None
    width = out.shape[1]
    grid = n + (triton.cdiv(width, COPY_BLOCK) if copy else 0)
    _MASKED_ARGMAX((grid,), logits, logits.stride(0), rows, bitmask, bitmask.stride(0),
                   bitmask.shape[1], vocab_size, out, out.stride(0), cols, agree,
                   mask_rows if shared else rows, source if copy else out,
                   source.stride(0) if copy else out.stride(0), n, width,
                   BLOCK_SIZE=ARGMAX_BLOCK, SHARED=shared, COPY=copy, COPY_BLOCK=COPY_BLOCK,
                   SCAN=SCAN)


# the columns a copying program takes, and the picked columns it compares them with at once
COPY_BLOCK = 512
SCAN = 32


# (launched outside the decode graphs at each step with masked rows: see FastLaunch)
_MASKED_ARGMAX = FastLaunch(_masked_argmax_kernel, num_warps=ARGMAX_WARPS)
