"""A decoder layer's projections fused with what runs around them: the residual
add and RMSNorm before, SwiGLU's gate after (``add_norm_gate_up_silu``).

The torch path is the reference (and the CPU's): the unfused ops. On CUDA one
Triton kernel (:mod:`norm_linear_triton`) computes each output tile, making the
normed rows and the gate|up projection as it goes, never writing them; it
rounds where the unfused kernels round, the sums (the GEMM's, each row's sum of
squares) in its own order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from formcast.engine.kernels import use_triton
from formcast.engine.kernels.activation import silu_and_mul
from formcast.engine.kernels.rmsnorm import add_rms_norm


def add_norm_gate_up_silu(x: torch.Tensor, addend: torch.Tensor, norm_weight: torch.Tensor,
                          eps: float, weight: torch.Tensor, *, backend: str = "auto"
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + addend, gate_up_silu(rms_norm(x + addend), weight))``: a decoder
    layer's residual add, its MLP's input norm, gate|up projection and gate:
    ``weight`` [2I, K] holds gate's rows, then up's; the result is [T, I]."""
    if use_triton(x, backend) and x.shape[0] > 0:
        from formcast.engine.kernels.norm_linear_triton import norm_linear_triton

        return norm_linear_triton(x, weight, (addend, norm_weight, eps), True)
    total, h = add_rms_norm(x, addend, norm_weight, eps, backend="torch")
    return total, silu_and_mul(F.linear(h, weight), backend="torch")


def add_norm_linear(x: torch.Tensor, addend: torch.Tensor, norm_weight: torch.Tensor,
                    eps: float, weight: torch.Tensor, *, backend: str = "auto"
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + addend, rms_norm(x + addend) @ weight.T)``: a decoder layer's
    residual add, its attention's input norm and q|k|v projection."""
    if use_triton(x, backend) and x.shape[0] > 0:
        from formcast.engine.kernels.norm_linear_triton import norm_linear_triton

        return norm_linear_triton(x, weight, (addend, norm_weight, eps), False)
    total, h = add_rms_norm(x, addend, norm_weight, eps, backend="torch")
    return total, F.linear(h, weight)
