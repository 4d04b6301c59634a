"""Triton RMSNorm (+ fused residual add) for CUDA: one program per row, the whole
row in registers (hidden sizes up to 16384), float32 arithmetic, one rounding to
the output dtype where the torch reference rounds."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def inverse_rms(xf, n, eps):
    """``1 / sqrt(mean(xf^2) + eps)`` of a float32 row ``xf`` of ``n`` values (zeros past them)."""
    return 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)


@triton.jit
def row_inverse_rms(s_ptr, n, eps, BLOCK_E: tl.constexpr):
    """:func:`inverse_rms` of the ``n`` values at ``s_ptr``."""
    e = tl.arange(0, BLOCK_E)
    return inverse_rms(tl.load(s_ptr + e, mask=e < n, other=0.0).to(tl.float32), n, eps)


@triton.jit
def _rms_norm_kernel(x_ptr, add_ptr, w_ptr, out_ptr, sum_ptr, n_cols, x_stride, add_stride,
                     out_stride, sum_stride, eps, HAS_ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=live, other=0.0)
    if HAS_ADD:
        a = tl.load(add_ptr + row * add_stride + cols, mask=live, other=0.0)
        x = (x.to(tl.float32) + a.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * sum_stride + cols, x, mask=live)
    xf = x.to(tl.float32)
    rstd = inverse_rms(xf, n_cols, eps)
    y = (xf * rstd).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=live, other=0.0)
    out = (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_stride + cols, out, mask=live)


def _launch(x: torch.Tensor, addend: torch.Tensor | None, weight: torch.Tensor, eps: float
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n_rows, n_cols = x2.shape
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(n_rows, n_cols, dtype=out_dtype, device=x.device)
    total = None
    add2 = x2
    if addend is not None:
        add2 = addend.reshape(-1, shape[-1])
        if add2.stride(-1) != 1:
            add2 = add2.contiguous()
        total = torch.empty_like(x2)
    block = triton.next_power_of_2(n_cols)
    if n_rows:
        _rms_norm_kernel[(n_rows,)](
            x2, add2, weight, out, total if total is not None else out, n_cols,
            x2.stride(0), add2.stride(0), out.stride(0),
            total.stride(0) if total is not None else 0, eps,
            HAS_ADD=addend is not None, BLOCK=block, num_warps=4 if block <= 4096 else 8)
    return out.view(shape), None if total is None else total.view(shape)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def add_rms_norm_triton(x: torch.Tensor, addend: torch.Tensor, weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    out, total = _launch(x, addend, weight, eps)
    return total, out
