"""Triton ``silu(gate) * up`` and ``gelu_tanh(gate) * up`` for CUDA: one program
per (row, tile of columns)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from formcast.engine.kernels.rmsnorm_triton import row_inverse_rms


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, s_ptr, half, stride_x, stride_o, stride_s, n_s, eps,
                     BLOCK: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_E: tl.constexpr,
                     GELU: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < half
    gate = tl.load(x_ptr + row * stride_x + cols, mask=live, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + half + cols, mask=live, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if HAS_SCALE:  # (rounded to the dtype, as the projection's output of a normed row is)
        r = row_inverse_rms(s_ptr + row * stride_s, n_s, eps, BLOCK_E)
        gate = (gate * r).to(dtype).to(tl.float32)
        up = (up * r).to(dtype).to(tl.float32)
    # the activation rounds to the output dtype before the product, as torch's two ops do
    if GELU:  # 0.5 g (1 + tanh(u)) = g * sigmoid(2 u), u = sqrt(2 / pi) (g + 0.044715 g^3)
        u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = (gate / (1.0 + tl.exp(-2.0 * u))).to(dtype).to(tl.float32)
    else:
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(dtype), mask=live)


def silu_and_mul_triton(x: torch.Tensor, half: int, scale_by: torch.Tensor | None = None,
                        eps: float = 0.0) -> torch.Tensor:
    """``scale_by``: see :func:`formcast.engine.kernels.activation.silu_and_mul`."""
    if x.stride(-1) != 1:
        raise ValueError("silu_and_mul: the last dimension must be contiguous")
    x2 = x.reshape(-1, x.shape[-1])
    s2 = x2 if scale_by is None else scale_by.reshape(-1, scale_by.shape[-1])
    if s2.stride(-1) != 1:
        s2 = s2.contiguous()
    out = torch.empty(x2.shape[0], half, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(half))
    _silu_mul_kernel[(x2.shape[0], triton.cdiv(half, block))](
        x2, out, s2, half, x2.stride(0), out.stride(0), s2.stride(0), s2.shape[1], eps,
        BLOCK=block, HAS_SCALE=scale_by is not None,
        BLOCK_E=triton.next_power_of_2(s2.shape[1]) if scale_by is not None else 16)
    return out.view(*x.shape[:-1], half)


def gelu_tanh_and_mul_triton(x: torch.Tensor, half: int) -> torch.Tensor:
    """See :func:`formcast.engine.kernels.activation.gelu_tanh_and_mul`."""
    if x.stride(-1) != 1:
        raise ValueError("gelu_tanh_and_mul: the last dimension must be contiguous")
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty(x2.shape[0], half, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(half))
    _silu_mul_kernel[(x2.shape[0], triton.cdiv(half, block))](
        x2, out, x2, half, x2.stride(0), out.stride(0), x2.stride(0), x2.shape[1], 0.0,
        BLOCK=block, HAS_SCALE=False, BLOCK_E=16, GELU=True)
    return out.view(*x.shape[:-1], half)
