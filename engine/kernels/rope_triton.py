"""Triton RoPE for CUDA, in place: one program per token, all its heads at once
(optionally storing the rotated keys and the values to the paged cache too)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(x_ptr, v_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr,
                 n_heads, n_q, half, x_stride_t, x_stride_h, v_stride_t, v_stride_h,
                 table_stride, c_stride_b, c_stride_t, c_stride_h, vc_stride_b,
                 vc_stride_t, vc_stride_h, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_KV: tl.constexpr, STORE: tl.constexpr):
    """Rotate token ``t``'s heads in place; with ``STORE``, also write its key heads
    (those after the ``n_q`` query heads) and its values to the cache slot."""
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
    dtype = x_ptr.dtype.element_ty
    # (fused multiply-adds written out: the fused decode attention kernel rotates
    # the same way, so both write the same bits to the cache)
    r1 = tl.fma(x1, c, -(x2 * s)).to(dtype)
    r2 = tl.fma(x2, c, x1 * s).to(dtype)
    tl.store(base, r1, mask=live)
    tl.store(base + half, r2, mask=live)
    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        block = slot // BLOCK_SIZE
        within = slot % BLOCK_SIZE
        kv_live = live & (heads >= n_q)
        kbase = (kc_ptr + block * c_stride_b + within * c_stride_t
                 + (heads - n_q) * c_stride_h + cols)
        tl.store(kbase, r1.to(kc_ptr.dtype.element_ty), mask=kv_live)
        tl.store(kbase + half, r2.to(kc_ptr.dtype.element_ty), mask=kv_live)
        kvh = tl.arange(0, BLOCK_KV)[:, None]
        dcols = tl.arange(0, 2 * BLOCK_D)[None, :]
        v_live = (kvh < n_heads - n_q) & (dcols < 2 * half)
        val = tl.load(v_ptr + t * v_stride_t + kvh * v_stride_h + dcols, mask=v_live, other=0.0)
        tl.store(vc_ptr + block * vc_stride_b + within * vc_stride_t + kvh * vc_stride_h + dcols,
                 val.to(vc_ptr.dtype.element_ty), mask=v_live)


def apply_rope_triton_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> None:
    """x [T, H, D] on CUDA (last dim contiguous), positions [T], tables [P, D] float32."""
    if x.stride(-1) != 1:
        raise ValueError("rope: the head dimension of x must be contiguous")
    t, h, d = x.shape
    half = d // 2
    cos = cos.to(device=x.device, dtype=torch.float32)
    sin = sin.to(device=x.device, dtype=torch.float32)
    positions = positions.to(x.device)
    # no cache: the pointers past the tables are placeholders the kernel never reads
    _rope_kernel[(t,)](x, x, positions, positions, cos, sin, x, x, h, h, half, x.stride(0),
                       x.stride(1), 0, 0, cos.stride(0), 0, 0, 0, 0, 0, 0, BLOCK_SIZE=1,
                       BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(half),
                       BLOCK_KV=1, STORE=False)


def apply_rope_and_store_kv_triton_(qk: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                                    cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                                    v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """qk [T, H + Hkv, D], v [T, Hkv, D] (last dims contiguous), caches
    [NBtotal, BS, Hkv, D], positions and slots [T], tables [P, D] float32."""
    if qk.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1 \
            or v_cache.stride(-1) != 1:
        raise ValueError("rope: the head dimension must be contiguous")
    t, h, d = qk.shape
    hkv = v.shape[1]
    half = d // 2
    cos = cos.to(device=qk.device, dtype=torch.float32)
    sin = sin.to(device=qk.device, dtype=torch.float32)
    _rope_kernel[(t,)](
        qk, v, positions, slots, cos, sin, k_cache, v_cache, h, h - hkv, half, qk.stride(0),
        qk.stride(1), v.stride(0), v.stride(1), cos.stride(0), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), BLOCK_SIZE=k_cache.shape[1], BLOCK_H=triton.next_power_of_2(h),
        BLOCK_D=triton.next_power_of_2(half), BLOCK_KV=triton.next_power_of_2(hkv),
        STORE=True)
