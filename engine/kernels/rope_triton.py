"""Triton RoPE for CUDA, in place: one program per token, all its heads at once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, n_heads, half, x_stride_t, x_stride_h,
                 table_stride, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    live = (heads < n_heads) & (cols < half)
    c = tl.load(cos_ptr + pos * table_stride + cols, mask=cols < half, other=0.0)
    s = tl.load(sin_ptr + pos * table_stride + cols, mask=cols < half, other=0.0)
    base = x_ptr + t * x_stride_t + heads * x_stride_h + cols
    x1 = tl.load(base, mask=live, other=0.0).to(tl.float32)
    x2 = tl.load(base + half, mask=live, other=0.0).to(tl.float32)
    tl.store(base, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty), mask=live)
    tl.store(base + half, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty), mask=live)


def apply_rope_triton_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> None:
    """x [T, H, D] on CUDA (last dim contiguous), positions [T], tables [P, D] float32."""
    if x.stride(-1) != 1:
        raise ValueError("rope: the head dimension of x must be contiguous")
    t, h, d = x.shape
    half = d // 2
    cos = cos.to(device=x.device, dtype=torch.float32)
    sin = sin.to(device=x.device, dtype=torch.float32)
    _rope_kernel[(t,)](x, positions.to(x.device), cos, sin, h, half, x.stride(0), x.stride(1),
                       cos.stride(0), BLOCK_H=triton.next_power_of_2(h),
                       BLOCK_D=triton.next_power_of_2(half))
