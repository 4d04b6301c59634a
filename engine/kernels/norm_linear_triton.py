"""Triton projections with what runs around them in a decoder layer, for CUDA.

One kernel, :func:`_norm_linear_kernel`: a tile of ``h @ weight.T`` where ``h``
is the input or, with ``NORM``, RMSNorm(x + addend) made as the tile goes (the
residual add and the norm kernel's roundings; the sum stored by the programs of
the first column tile), and with ``GATE`` the weight is a fused gate|up
projection whose two halves' tiles of the same columns are accumulated side by
side and stored as ``silu(gate) * up``. The fused intermediate tensors (the
normed rows, the [T, 2I] projection) are never written, and a layer makes two or
three launches fewer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_linear_kernel(x_ptr, add_ptr, norm_ptr, sum_ptr, w_ptr, out_ptr, rows, cols, k,
                        stride_x, stride_add, stride_sum, stride_w, stride_o, eps,
                        NORM: tl.constexpr, GATE: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Output columns ``n`` of rows ``m``: ``h @ weight[n].T`` (``GATE``: of
    weight rows ``n`` and ``cols + n``, each rounded to the output dtype as a
    GEMM's output is, then silu and the product rounded as the activation
    kernel rounds them), accumulated in float32 over ``k``. ``NORM``: each row's
    1 / rms of x + addend is found in a first pass over its columns, and ``h``
    rounded where the norm kernel rounds."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    live_m = m < rows
    live_n = n < cols
    dtype = out_ptr.dtype.element_ty
    x_rows = x_ptr + m[:, None].to(tl.int64) * stride_x
    add_rows = add_ptr + m[:, None].to(tl.int64) * stride_add
    if NORM:  # each row's 1 / rms of x + addend
        squares = tl.zeros([BLOCK_M], tl.float32)
        for start in range(0, k, BLOCK_K):
            ks = start + kk
            xmask = live_m[:, None] & (ks < k)[None, :]
            total = (tl.load(x_rows + ks[None, :], mask=xmask, other=0.0).to(tl.float32) +
                     tl.load(add_rows + ks[None, :], mask=xmask, other=0.0).to(tl.float32)
                     ).to(dtype)
            if tl.program_id(1) == 0:
                tl.store(sum_ptr + m[:, None].to(tl.int64) * stride_sum + ks[None, :], total,
                         mask=xmask)
            total = total.to(tl.float32)
            squares += tl.sum(total * total, axis=1)
        rstd = 1.0 / tl.sqrt(squares / k + eps)
    w_rows = w_ptr + n[None, :].to(tl.int64) * stride_w            # [1, N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if GATE:
        up_rows = w_rows + cols * stride_w
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, k, BLOCK_K):
        ks = start + kk
        live_k = ks < k
        xmask = live_m[:, None] & live_k[None, :]
        a = tl.load(x_rows + ks[None, :], mask=xmask, other=0.0)
        if NORM:
            total = (a.to(tl.float32) +
                     tl.load(add_rows + ks[None, :], mask=xmask, other=0.0).to(tl.float32)
                     ).to(dtype).to(tl.float32)
            y = (total * rstd[:, None]).to(dtype).to(tl.float32)
            scale = tl.load(norm_ptr + ks, mask=live_k, other=0.0).to(tl.float32)
            a = (scale[None, :] * y).to(dtype)
        wmask = live_k[:, None] & live_n[None, :]
        acc = tl.dot(a, tl.load(w_rows + ks[:, None], mask=wmask, other=0.0), acc)
        if GATE:
            up = tl.dot(a, tl.load(up_rows + ks[:, None], mask=wmask, other=0.0), up)
    if GATE:
        g = acc.to(dtype).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        out = (act * up.to(dtype).to(tl.float32)).to(dtype)
    else:
        out = acc.to(dtype)
    tl.store(out_ptr + m[:, None].to(tl.int64) * stride_o + n[None, :], out,
             mask=live_m[:, None] & live_n[None, :])


# rows at most -> (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages); the last entry takes the rest
CONFIGS: list[tuple[int, tuple[int, int, int, int, int]]] = [
    (16, (16, 64, 128, 4, 3)),
    (64, (64, 64, 64, 4, 3)),
    (1 << 62, (64, 128, 64, 4, 3)),
]


def norm_linear_triton(x: torch.Tensor, weight: torch.Tensor,
                       norm: tuple[torch.Tensor, torch.Tensor, float] | None, gate: bool
                       ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``h @ weight.T`` (``gate``: ``silu(h @ weight[:I].T) * (h @ weight[I:].T)``)
    in one launch: ``x`` [T, K], ``weight`` [N or 2I, K]; ``h`` is ``x``, or with
    ``norm`` = (addend, norm weight, eps) RMSNorm(x + addend). Returns (x + addend
    or None, the result)."""
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("norm_linear: the last dimension must be contiguous")
    rows, k = x.shape
    cols = weight.shape[0] // 2 if gate else weight.shape[0]
    out = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    total = None
    addend, scale, eps = x, x, 0.0
    if norm is not None:
        addend, scale, eps = norm
        if addend.stride(-1) != 1:
            raise ValueError("norm_linear: the last dimension must be contiguous")
        total = torch.empty_like(x)
    block_m, block_n, block_k, warps, stages = next(
        config for most, config in CONFIGS if rows <= most)
    _norm_linear_kernel[(triton.cdiv(rows, block_m), triton.cdiv(cols, block_n))](
        x, addend, scale, out if total is None else total, weight, out, rows, cols, k,
        x.stride(0), addend.stride(0), 0 if total is None else total.stride(0),
        weight.stride(0), out.stride(0), eps, NORM=norm is not None, GATE=gate,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return total, out
