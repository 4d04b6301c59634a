"""Batch-invariant GEMM for CUDA half-precision linears (Triton).

``y = x W^T (+ b)`` on tiles whose configuration (a :class:`GemmPlan`) is chosen
from the weight's shape and the device alone, never from the number of rows M
(cuBLAS picks kernels, tiles and split-K by M, so a row rounds differently alone
and among 255 others). Each output tile reduces K tile after tile in order into
a float32 accumulator. With one split, one program does the whole K; with
``splits`` S, the programs of a tile each reduce one S-th of K, write their
float32 partial sums, and the last of them to arrive (an atomic count) adds the
S partials in split order and finishes the tile: a fixed order of additions
whichever program comes last, and no second launch. A row's outputs then come
from the same instructions in the same order in any batch: the tensor-core
product computes each row of a tile the same way, and rows past M are loaded as
zeros and never stored.

Three steps of a decoder layer ride on the product (each optional, each a
function of the row alone):

- ``scale_eps``: the row's inverse root mean square over K (an RMSNorm whose
  weight was folded into W) scales the product;
- ``gated``: W holds a gate half and an up half; the program multiplies both and
  writes ``silu(gate) * up`` (the MLP's activation), half the columns;
- ``residual``: the product is added to a residual row (the stream's update).

Shapes: M rows, K inner, N outputs, S splits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

WORKSPACE = 1 << 24  # float32 partial sums one split launch may write (64 MiB)
COUNTERS = 1 << 16  # a device's arrival counters (tiles of one split launch, at most)


@dataclass(frozen=True)
class GemmPlan:
    """How :func:`invariant_linear_triton` tiles a product (a function of N, K and
    the device only): rows, columns and inner values a tile, splits of K, warps
    and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 3


@functools.cache
def _programs_at_once(device: torch.device) -> int:
    """Programs the device runs at once (its multiprocessor count; 8 for the
    interpreter on the CPU)."""
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _counters(device: torch.device) -> torch.Tensor:
    """The device's arrival counters: zeros, and zeros again after every launch
    (the last program of a tile resets its own)."""
    return torch.zeros(COUNTERS, dtype=torch.int32, device=device)


@functools.cache
def gemm_plan(n: int, k: int, device: torch.device) -> GemmPlan:
    """The plan for a weight of ``n`` outputs and ``k`` inputs on ``device``: column
    tiles of 128 for outputs wide enough to fill the device with them (a
    vocabulary), else of 32 (a decode step's one row tile then still spreads over
    many programs); inner tiles of 64."""
    wide = triton.cdiv(n, 128) >= _programs_at_once(device)
    return GemmPlan(block_m=64, block_n=128 if wide else 32, block_k=64)


@triton.jit
def _finish(acc, acc_up, squares, b_ptr, r_ptr, y_ptr, rm, rn, live_m, live_n, up, K, srm, sym,
            eps, HAS_BIAS: tl.constexpr, SCALE: tl.constexpr, GATED: tl.constexpr,
            RESIDUAL: tl.constexpr):
    """A tile's epilogue: the row scale, the bias, the gate, the residual, the store."""
    if SCALE:  # (an RMSNorm's 1 / sqrt(mean(x^2) + eps) of the row)
        inv = 1.0 / tl.sqrt(squares / K + eps)
        acc = acc * inv[:, None]
        acc_up = acc_up * inv[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=live_n, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(b_ptr + up + rn, mask=live_n, other=0.0).to(tl.float32)[None, :]
    dtype = y_ptr.dtype.element_ty
    out = live_m[:, None] & live_n[None, :]
    if GATED:  # (rounded where the projection's output and the activation round)
        gate = acc.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        acc = act * acc_up.to(dtype).to(tl.float32)
    if RESIDUAL:
        acc += tl.load(r_ptr + rm[:, None] * srm + rn[None, :], mask=out, other=0.0
                       ).to(tl.float32)
    tl.store(y_ptr + rm[:, None] * sym + rn[None, :], acc.to(dtype), mask=out)


@triton.jit
def _invariant_mm_kernel(x_ptr, w_ptr, b_ptr, r_ptr, y_ptr, part_ptr, count_ptr, M, N, K, up,
                         sxm, swn, srm, sym, eps, k_per_split, HAS_BIAS: tl.constexpr,
                         SCALE: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
                         SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    # (row tiles on the fast axis: programs sharing a weight tile run together)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    live_m = rm < M
    live_n = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        kk = k0 + rk
        live_k = kk < K  # (a split's tiles never cross into the next: it holds whole tiles)
        x = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :],
                    mask=live_m[:, None] & live_k[None, :], other=0.0)
        w = tl.load(w_ptr + rn[:, None] * swn + kk[None, :],
                    mask=live_n[:, None] & live_k[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)                                  # [BM, BN] float32
        if GATED:
            wu = tl.load(w_ptr + (up + rn)[:, None] * swn + kk[None, :],
                         mask=live_n[:, None] & live_k[None, :], other=0.0)
            acc_up = tl.dot(x, tl.trans(wu), acc_up)
        if SCALE:
            xf = x.to(tl.float32)
            squares += tl.sum(xf * xf, axis=1)
    if SPLITS == 1:
        _finish(acc, acc_up, squares, b_ptr, r_ptr, y_ptr, rm, rn, live_m, live_n, up, K, srm,
                sym, eps, HAS_BIAS, SCALE, GATED, RESIDUAL)
    else:
        # partials at part[tile, split, (acc, acc_up, squares)]; the last to arrive
        # adds them in split order
        tile = pid_n * tl.num_programs(0) + pid_m
        width = BLOCK_M * BLOCK_N * 2 + BLOCK_M
        cell = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        at = part_ptr + (tile * SPLITS + split).to(tl.int64) * width
        tl.store(at + cell, acc)
        if GATED:
            tl.store(at + BLOCK_M * BLOCK_N + cell, acc_up)
        if SCALE:
            tl.store(at + 2 * BLOCK_M * BLOCK_N + tl.arange(0, BLOCK_M), squares)
        tl.debug_barrier()  # (every thread's partials stored before the release)
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLITS - 1:
            first = part_ptr + (tile * SPLITS).to(tl.int64) * width
            acc = tl.load(first + cell, cache_modifier=".cg")
            if GATED:
                acc_up = tl.load(first + BLOCK_M * BLOCK_N + cell, cache_modifier=".cg")
            if SCALE:
                squares = tl.load(first + 2 * BLOCK_M * BLOCK_N + tl.arange(0, BLOCK_M),
                                  cache_modifier=".cg")
            for s in tl.static_range(1, SPLITS):
                at_s = first + s * width
                acc += tl.load(at_s + cell, cache_modifier=".cg")
                if GATED:
                    acc_up += tl.load(at_s + BLOCK_M * BLOCK_N + cell, cache_modifier=".cg")
                if SCALE:
                    squares += tl.load(at_s + 2 * BLOCK_M * BLOCK_N + tl.arange(0, BLOCK_M),
                                       cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + tile, 0)  # (zero again for the next launch)
            _finish(acc, acc_up, squares, b_ptr, r_ptr, y_ptr, rm, rn, live_m, live_n, up, K,
                    srm, sym, eps, HAS_BIAS, SCALE, GATED, RESIDUAL)


def invariant_linear_triton(x: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None = None, *,
                            out_dtype: torch.dtype | None = None,
                            scale_eps: float | None = None, gated: bool = False,
                            residual: torch.Tensor | None = None,
                            plan: GemmPlan | None = None) -> torch.Tensor:
    """``x`` [M, K] times ``weight`` [N, K] transposed (plus ``bias`` [N]) by the
    fixed plan of :func:`gemm_plan`; float32 accumulation, written in ``out_dtype``
    (default ``x``'s dtype). ``scale_eps``: each row's product scaled by
    ``1 / sqrt(mean(x_row^2) + scale_eps)`` first; ``gated``: ``weight`` is
    [2I, K], gate rows then up rows, and the result is ``silu(gate) * up``
    [M, I]; ``residual`` [M, N']: added to the result. ``plan``: another fixed
    plan (benchmarks). Returns [M, N] (or [M, I])."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return y
    plan = plan or gemm_plan(weight.shape[0], k, x.device)
    if residual is not None and (residual.shape != y.shape or residual.stride(1) != 1):
        raise ValueError(f"invariant GEMM: residual of shape {tuple(residual.shape)} for an "
                         f"output of {tuple(y.shape)} (contiguous rows)")
    bm, bn, s = plan.block_m, plan.block_n, plan.splits
    k_tiles = triton.cdiv(k, plan.block_k)
    k_per_split = triton.cdiv(k_tiles, s) * plan.block_k
    n_tiles = triton.cdiv(n, bn)
    rows = m
    part = count = y
    if s > 1:  # (launches of at most so many rows that their partials fit the workspace)
        width = bm * bn * 2 + bm
        rows = min(m, max(bm, min(WORKSPACE // (n_tiles * s * width), COUNTERS // n_tiles)
                          // bm * bm))
        part = torch.empty(triton.cdiv(rows, bm) * n_tiles * s * width, dtype=torch.float32,
                           device=x.device)
        count = _counters(x.device)
    for r0 in range(0, m, rows):
        xs, ys = x[r0:r0 + rows], y[r0:r0 + rows]
        res = residual[r0:r0 + rows] if residual is not None else ys
        ms = xs.shape[0]
        _invariant_mm_kernel[(triton.cdiv(ms, bm), n_tiles, s)](
            xs, weight, bias if bias is not None else weight, res, ys, part, count, ms, n, k,
            n, xs.stride(0), weight.stride(0), res.stride(0), ys.stride(0),
            float(scale_eps) if scale_eps is not None else 0.0, k_per_split,
            HAS_BIAS=bias is not None, SCALE=scale_eps is not None, GATED=gated,
            RESIDUAL=residual is not None, SPLITS=s, BLOCK_M=bm, BLOCK_N=bn,
            BLOCK_K=plan.block_k, num_warps=plan.num_warps, num_stages=plan.num_stages)
    return y
