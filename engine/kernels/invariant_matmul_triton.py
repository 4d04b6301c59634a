"""Batch-invariant GEMM for CUDA half-precision linears (Triton).

``y = x W^T (+ b)`` on tiles of fixed size, with the inner dimension K cut into
a fixed number of splits: a :class:`GemmPlan` is chosen from the weight's shape
and the device alone, never from the number of rows M (cuBLAS picks kernels,
tiles and split-K by M, so a row rounds differently alone and among 255
others). One program per (row tile, column tile, split) reduces its split's
K tiles in order; with several splits each writes float32 partial sums and a
second kernel adds the splits in order (no atomics). A row's outputs then come
from the same instructions in the same order in any batch: the tensor-core
product computes each row of a tile the same way, and rows past M are loaded
as zeros and never stored.

Why split K at all: a decode step has few rows, so a small model's projections
have few column tiles (a 576-wide output is 9 tiles of 64); splitting K gives
the device enough programs to run at once, the way cuBLAS's split-K does, but
by the same plan for every M. Partial sums take a workspace of at most
``workspace`` float32 values: more rows run in several launches of the same plan.

Shapes: M rows, K inner, N outputs, S splits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_M = 64
BLOCK_K = 64
WORKSPACE = 1 << 24  # float32 partial sums one launch may write (64 MiB)
REDUCE_BLOCK = 1024


@dataclass(frozen=True)
class GemmPlan:
    """How :func:`invariant_linear_triton` cuts a product: columns a tile, splits
    of K and K tiles a split (a function of N, K and the device only)."""

    block_n: int
    splits: int
    tiles_per_split: int


@functools.cache
def _programs_at_once(device: torch.device) -> int:
    """Programs the device runs at once (its multiprocessor count; 8 for the
    interpreter on the CPU)."""
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def gemm_plan(n: int, k: int, device: torch.device) -> GemmPlan:
    """The plan for a weight of ``n`` outputs and ``k`` inputs on ``device``: column
    tiles of 64 (128 for wide outputs such as a vocabulary), and K split until one
    row tile has about as many programs as the device runs at once, each split at
    least two K tiles."""
    block_n = 128 if n >= 8192 else 64
    n_tiles = triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, BLOCK_K)
    want = max(1, min(_programs_at_once(device) // n_tiles, k_tiles // 2))
    per = triton.cdiv(k_tiles, want)
    return GemmPlan(block_n=block_n, splits=triton.cdiv(k_tiles, per), tiles_per_split=per)


@triton.jit
def _invariant_mm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, sxm, sxk, swn, swk, sym, syn,
                         sys, tiles_per_split, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = split * tiles_per_split * BLOCK_K
    k_end = tl.minimum(k_begin + tiles_per_split * BLOCK_K, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :] * sxk,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[:, None] * swn + kk[None, :] * swk,
                    mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)                                  # [BM, BN] float32
    out = (rm[:, None] < M) & (rn[None, :] < N)
    if PARTIAL:  # this split's float32 sums; _split_sum_kernel adds the splits
        tl.store(y_ptr + split * sys + rm[:, None] * sym + rn[None, :] * syn, acc, mask=out)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * sym + rn[None, :] * syn,
                 acc.to(y_ptr.dtype.element_ty), mask=out)


@triton.jit
def _split_sum_kernel(part_ptr, b_ptr, y_ptr, M, N, sym, syn, SPLITS: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    # y[m, n] = (part[0, m, n] + part[1, m, n] + ...) (+ b[n]), the splits in order
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = idx < M * N
    acc = tl.load(part_ptr + idx, mask=live, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(part_ptr + s * M * N + idx, mask=live, other=0.0)
    col = idx % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + col, mask=live, other=0.0).to(tl.float32)
    tl.store(y_ptr + (idx // N) * sym + col * syn, acc.to(y_ptr.dtype.element_ty), mask=live)


def invariant_linear_triton(x: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None = None, *,
                            out_dtype: torch.dtype | None = None,
                            workspace: int = WORKSPACE) -> torch.Tensor:
    """``x`` [M, K] times ``weight`` [N, K] transposed (plus ``bias`` [N]) by the
    fixed plan of :func:`gemm_plan`; float32 accumulation, written in ``out_dtype``
    (default ``x``'s dtype). ``workspace``: float32 partial sums a launch may
    write (more rows: several launches). Returns [M, N]."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return y
    plan = gemm_plan(n, k, x.device)
    b = bias if bias is not None else weight
    n_tiles = triton.cdiv(n, plan.block_n)
    if plan.splits == 1:
        _invariant_mm_kernel[(triton.cdiv(m, BLOCK_M), n_tiles, 1)](
            x, weight, b, y, m, n, k, x.stride(0), x.stride(1), weight.stride(0),
            weight.stride(1), y.stride(0), y.stride(1), 0, plan.tiles_per_split,
            HAS_BIAS=bias is not None, PARTIAL=False, BLOCK_M=BLOCK_M, BLOCK_N=plan.block_n,
            BLOCK_K=BLOCK_K, num_warps=4, num_stages=3)
        return y
    rows = max(BLOCK_M, workspace // (plan.splits * n) // BLOCK_M * BLOCK_M)
    part = torch.empty(plan.splits, min(rows, m), n, dtype=torch.float32, device=x.device)
    for r0 in range(0, m, rows):
        xs, ys = x[r0:r0 + rows], y[r0:r0 + rows]
        ms = xs.shape[0]
        _invariant_mm_kernel[(triton.cdiv(ms, BLOCK_M), n_tiles, plan.splits)](
            xs, weight, b, part, ms, n, k, xs.stride(0), xs.stride(1), weight.stride(0),
            weight.stride(1), n, 1, ms * n, plan.tiles_per_split, HAS_BIAS=False,
            PARTIAL=True, BLOCK_M=BLOCK_M, BLOCK_N=plan.block_n, BLOCK_K=BLOCK_K,
            num_warps=4, num_stages=3)
        _split_sum_kernel[(triton.cdiv(ms * n, REDUCE_BLOCK),)](
            part, b, ys, ms, n, ys.stride(0), ys.stride(1), SPLITS=plan.splits,
            HAS_BIAS=bias is not None, BLOCK=REDUCE_BLOCK, num_warps=4)
    return y
