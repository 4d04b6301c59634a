"""RMSNorm, optionally fused with the residual add before it.

``rms_norm(x, w, eps)`` is Llama's norm: computed in float32 over the last
dimension and cast back, then scaled by the weight in the input's dtype.
``add_rms_norm(x, a, w, eps)`` returns ``(x + a, rms_norm(x + a))``, the pair a
decoder layer needs between its attention and its MLP, in one pass over memory on
CUDA. The torch path is the reference (and what the CPU runs, op for op as the
model always did); the Triton path runs on CUDA tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from formcast.engine.kernels import use_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             backend: str = "auto") -> torch.Tensor:
    """``x`` [..., E] normalized over E and scaled by ``weight`` [E]."""
    if use_triton(x, backend):
        from formcast.engine.kernels.rmsnorm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # torch's fused op: the same arithmetic as below (bitwise), in one kernel
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * scale_rows(x, x, eps)


def inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``1 / sqrt(mean(x^2) + eps)`` over the last dimension, in float32, kept as a
    size-1 dimension: the factor an RMSNorm scales a row by (before its weight)."""
    xf = x.float()
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def scale_rows(x: torch.Tensor, by: torch.Tensor, eps: float) -> torch.Tensor:
    """Each row of ``x`` times the :func:`inverse_rms` of that row of ``by``, in
    float32, rounded to ``x``'s dtype: a weightless norm of ``by`` applied to ``x``
    (``by`` is ``x`` for the norm itself; a norm whose weight was folded into the
    projection after it scales that projection's output so)."""
    xf = x.float()
    return (xf * inverse_rms(xf if by is x else by, eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, addend: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + addend, rms_norm(x + addend))``; the sum rounds to ``x``'s dtype
    before it is normalized, as the unfused ops do."""
    if use_triton(x, backend):
        from formcast.engine.kernels.rmsnorm_triton import add_rms_norm_triton

        return add_rms_norm_triton(x, addend, weight, eps)
    total = x + addend
    return total, rms_norm(total, weight, eps, backend="torch")
