"""Triton ``silu(gate) * up`` for CUDA: one program per (row, tile of columns)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, half, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < half
    gate = tl.load(x_ptr + row * stride_x + cols, mask=live, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + half + cols, mask=live, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # silu rounds to the output dtype before the product, as torch's two ops do
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(dtype), mask=live)


def silu_and_mul_triton(x: torch.Tensor, half: int) -> torch.Tensor:
    if x.stride(-1) != 1:
        raise ValueError("silu_and_mul: the last dimension must be contiguous")
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty(x2.shape[0], half, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(half))
    _silu_mul_kernel[(x2.shape[0], triton.cdiv(half, block))](x2, out, half, x2.stride(0),
                                                              out.stride(0), BLOCK=block)
    return out.view(*x.shape[:-1], half)


@triton.jit
def _gate_up_silu_kernel(x_ptr, add_ptr, norm_ptr, sum_ptr, w_ptr, out_ptr, rows, half, k,
                         stride_x, stride_add, stride_sum, stride_w, stride_o, eps,
                         NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """One tile of ``silu(h @ gate.T) * (h @ up.T)``: the gate's and up's tiles
    of the same columns (weight rows ``n`` and ``half + n``) accumulated side by
    side over ``k`` in float32, each rounded to the output dtype as the GEMM's
    output is, then silu and the product rounded as :func:`_silu_mul_kernel`
    rounds them. ``h`` is ``x``; with ``NORM`` it is RMSNorm(x + addend) made as
    the tile goes (the sum rounded, each row's scale found in a first pass over
    its ``k`` columns, rounded where the norm kernel rounds), the programs of the
    first column tile storing the sum."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    live_m = m < rows
    live_n = n < half
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
    gate_rows = w_ptr + n[None, :].to(tl.int64) * stride_w          # [1, N]: weight [2 half, k]
    up_rows = gate_rows + half * stride_w
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
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
        gate = tl.dot(a, tl.load(gate_rows + ks[:, None], mask=wmask, other=0.0), gate)
        up = tl.dot(a, tl.load(up_rows + ks[:, None], mask=wmask, other=0.0), up)
    g = gate.to(dtype).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    out = (act * up.to(dtype).to(tl.float32)).to(dtype)
    tl.store(out_ptr + m[:, None].to(tl.int64) * stride_o + n[None, :], out,
             mask=live_m[:, None] & live_n[None, :])


# rows at most -> (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages); the last entry takes the rest
GATE_UP_CONFIGS: list[tuple[int, tuple[int, int, int, int, int]]] = [
    (16, (16, 64, 128, 4, 3)),
    (64, (64, 64, 64, 4, 3)),
    (1 << 62, (64, 128, 64, 4, 3)),
]


def gate_up_silu_triton(x: torch.Tensor, weight: torch.Tensor,
                        norm: tuple[torch.Tensor, torch.Tensor, float] | None = None
                        ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``silu(h @ weight[:half].T) * (h @ weight[half:].T)`` in one launch:
    ``x`` [T, K], ``weight`` [2 half, K] (a fused gate|up projection's); ``h``
    is ``x``, or with ``norm`` = (addend, norm weight, eps) RMSNorm(x + addend).
    Returns (x + addend or None, the result)."""
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("gate_up_silu: the last dimension must be contiguous")
    rows, k = x.shape
    half = weight.shape[0] // 2
    out = torch.empty(rows, half, dtype=x.dtype, device=x.device)
    total = None
    addend, scale, eps = x, x, 0.0
    if norm is not None:
        addend, scale, eps = norm
        if addend.stride(-1) != 1:
            raise ValueError("gate_up_silu: the last dimension must be contiguous")
        total = torch.empty_like(x)
    block_m, block_n, block_k, warps, stages = next(
        config for most, config in GATE_UP_CONFIGS if rows <= most)
    _gate_up_silu_kernel[(triton.cdiv(rows, block_m), triton.cdiv(half, block_n))](
        x, addend, scale, out if total is None else total, weight, out, rows, half, k,
        x.stride(0), addend.stride(0), 0 if total is None else total.stride(0),
        weight.stride(0), out.stride(0), eps, NORM=norm is not None, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return total, out
