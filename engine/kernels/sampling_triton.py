"""Triton batched sampling for CUDA: one program per row, the vocabulary in chunks.

The top-k and top-p thresholds are found by bisection on the logit value (each
step one pass over the row, which stays in cache): the largest threshold that
still keeps k tokens, then the largest that still keeps probability mass p.
Noise comes from ``tl.rand`` (Philox) keyed by the row's seed and the token id.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from formcast.engine.kernels.bitmask_triton import fold_first_max

ITERS = 40  # bisection steps: the logit range shrinks 2**40-fold, far below float32 spacing


@triton.jit
def _sample_kernel(logits_ptr, tokens_ptr, thr_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr,
                   seed_ptr, vocab, stride, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    t = tl.load(temp_ptr + row)
    k = tl.load(topk_ptr + row)
    p = tl.load(topp_ptr + row)
    mp = tl.load(minp_ptr + row)
    seed = tl.load(seed_ptr + row)
    cols = tl.arange(0, BLOCK)
    hi = tl.full([], float("-inf"), tl.float32)
    lo = tl.full([], float("inf"), tl.float32)
    for c in range(0, vocab, BLOCK):
        x = tl.load(base + c + cols, mask=c + cols < vocab, other=float("-inf"))
        hi = tl.maximum(hi, tl.max(x, axis=0))
        lo = tl.minimum(lo, tl.min(tl.where(x == float("-inf"), float("inf"), x), axis=0))
    thr = lo
    if k > 0:
        a = lo
        b = hi
        for _ in range(ITERS):
            mid = a + (b - a) * 0.5
            count = tl.full([], 0, tl.int32)
            for c in range(0, vocab, BLOCK):
                x = tl.load(base + c + cols, mask=c + cols < vocab, other=float("-inf"))
                count += tl.sum((x >= mid).to(tl.int32), axis=0)
            keep = count >= k
            a = tl.where(keep, mid, a)
            b = tl.where(keep, b, mid)
        thr = a
    if p < 1.0:
        total = tl.full([], 0.0, tl.float32)
        for c in range(0, vocab, BLOCK):
            x = tl.load(base + c + cols, mask=c + cols < vocab, other=float("-inf"))
            total += tl.sum(tl.where(x >= thr, tl.exp((x - hi) / t), 0.0), axis=0)
        a = thr
        b = hi
        for _ in range(ITERS):
            mid = a + (b - a) * 0.5
            mass = tl.full([], 0.0, tl.float32)
            for c in range(0, vocab, BLOCK):
                x = tl.load(base + c + cols, mask=c + cols < vocab, other=float("-inf"))
                mass += tl.sum(tl.where(x >= mid, tl.exp((x - hi) / t), 0.0), axis=0)
            keep = mass >= p * total
            a = tl.where(keep, mid, a)
            b = tl.where(keep, b, mid)
        thr = a
    if mp > 0.0:
        thr = tl.maximum(thr, hi + t * tl.log(mp))
    best = tl.full([], float("-inf"), tl.float32)
    best_id = tl.full([], 0, tl.int32)
    for c in range(0, vocab, BLOCK):
        offs = c + cols
        x = tl.load(base + offs, mask=offs < vocab, other=float("-inf"))
        u = tl.maximum(tl.rand(seed, offs), 1e-20)
        score = tl.where((x >= thr) & (x > float("-inf")), x / t - tl.log(-tl.log(u)),
                         float("-inf"))
        chunk_best = tl.max(score, axis=0)
        chunk_id = (tl.argmax(score, axis=0) + c).to(tl.int32)
        better = chunk_best > best
        best_id = tl.where(better, chunk_id, best_id)
        best = tl.where(better, chunk_best, best)
    tl.store(tokens_ptr + row, best_id.to(tl.int64))
    tl.store(thr_ptr + row, thr)


def sample_triton(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError("sampling: logits must be float32 with contiguous rows")
    b, vocab = logits.shape
    dev = logits.device
    tokens = torch.empty(b, dtype=torch.long, device=dev)
    thr = torch.empty(b, dtype=torch.float32, device=dev)
    _sample_kernel[(b,)](
        logits, tokens, thr, temperature.to(dev, torch.float32), top_k.to(dev, torch.int32),
        top_p.to(dev, torch.float32), min_p.to(dev, torch.float32), seeds.to(dev, torch.int32),
        vocab, logits.stride(0), BLOCK=4096, ITERS=ITERS)
    return tokens, thr


# Greedy picks split each row over programs of GREEDY_CHUNK ids (a second kernel
# takes the best of a row's parts): 256 rows of 49152 ids make 2048 programs
# rather than 256 that each walk 192 KB alone.
GREEDY_CHUNK = 6144
GREEDY_BLOCK = 2048


@triton.jit
def _greedy_part_kernel(logits_ptr, stride, vocab, val_ptr, idx_ptr, CHUNK: tl.constexpr,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    begin = part * CHUNK
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = begin  # (a part of -inf only: its first id)
    for start in range(begin, begin + CHUNK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + row * stride + offs, mask=offs < vocab,
                    other=float("-inf")).to(tl.float32)
        best, best_idx = fold_first_max(x, offs, best, best_idx, vocab)
    tl.store(val_ptr + row * parts + part, best)
    tl.store(idx_ptr + row * parts + part, best_idx)


@triton.jit
def _greedy_merge_kernel(val_ptr, idx_ptr, out_ptr, out_stride, parts, PARTS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, PARTS)
    live = p < parts
    v = tl.load(val_ptr + row * parts + p, mask=live, other=float("-inf"))
    i = tl.load(idx_ptr + row * parts + p, mask=live, other=2**30)
    m = tl.max(v, axis=0)
    first = tl.min(tl.where(v == m, i, 2**30), axis=0)  # ties: the earliest part's
    tl.store(out_ptr + row, first.to(tl.int64))
    tl.store(out_ptr + out_stride + row, (m == float("-inf")).to(tl.int64))


def greedy_picks_triton(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """See :func:`formcast.engine.kernels.sampling.greedy_picks` (CUDA tensors)."""
    if logits.stride(1) != 1:
        raise ValueError("logits rows must be contiguous")
    rows = logits.shape[0]
    parts = triton.cdiv(vocab_size, GREEDY_CHUNK)
    out = torch.empty(2, rows, dtype=torch.long, device=logits.device)
    if rows == 0:
        return out
    vals = torch.empty(rows, parts, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows, parts, dtype=torch.int32, device=logits.device)
    _greedy_part_kernel[(rows, parts)](logits, logits.stride(0), vocab_size, vals, idx,
                                       CHUNK=GREEDY_CHUNK, BLOCK=GREEDY_BLOCK, num_warps=4)
    _greedy_merge_kernel[(rows,)](vals, idx, out, out.stride(0), parts,
                                  PARTS=max(triton.next_power_of_2(parts), 2), num_warps=1)
    return out
