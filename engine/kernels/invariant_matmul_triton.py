"""Batch-invariant GEMM for CUDA half-precision linears (Triton).

``y = x W^T (+ b)``: one program per (row tile, column tile) of the output, with
tiles of fixed size whatever the number of rows M, and the whole inner dimension
K reduced inside the program, tile after tile in order (no split-K, no
stream-K, no choice of kernel by shape as cuBLAS makes). A row's outputs then
come from the same instructions in the same order alone or among 255 others:
the tensor-core product computes each row of a tile the same way, and rows past
M are loaded as zeros and never stored.

Shapes: M rows, K inner, N outputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 64
BLOCK_N = 128
BLOCK_K = 64


@triton.jit
def _invariant_mm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, sxm, sxk, swn, swk, sym, syn,
                         HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :] * sxk,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[:, None] * swn + kk[None, :] * swk,
                    mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)                                  # [BM, BN] float32
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * sym + rn[None, :] * syn,
             acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def invariant_linear_triton(x: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None = None, *,
                            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` [M, K] times ``weight`` [N, K] transposed (plus ``bias`` [N]) on the
    fixed-tile kernel; float32 accumulation, written in ``out_dtype`` (default
    ``x``'s dtype). Returns [M, N]."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return y
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _invariant_mm_kernel[grid](
        x, weight, bias if bias is not None else weight, y, m, n, k,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        num_warps=4, num_stages=3)
    return y
