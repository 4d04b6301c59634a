"""Triton kernel: set disallowed logits to -inf from packed bitmasks (CUDA).

One program per (mask row, block of vocabulary). Only disallowed entries are
written, logits are never read, and rows without a constraint are skipped by
index, so the cost is one pass over the constrained rows' masks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
