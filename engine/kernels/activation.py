"""SwiGLU's gate: ``silu(gate) * up`` of a fused gate|up projection, in one pass;
and the projection with it (:func:`gate_up_silu`), and the residual add and norm
before it too (:func:`add_norm_gate_up_silu`).

``x`` [T, 2 I] holds the gate in its first half and up in its second; the result
is [T, I] in ``x``'s dtype. The torch path is the reference (and the CPU's): silu
rounds to the dtype, then the product does, as the two unfused ops round. The
Triton kernel on CUDA rounds the same way in one launch instead of two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from formcast.engine.kernels import use_triton
from formcast.engine.kernels.rmsnorm import add_rms_norm


def silu_and_mul(x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    half = x.shape[-1] // 2
    if use_triton(x, backend) and x.shape[0] > 0:
        from formcast.engine.kernels.activation_triton import silu_and_mul_triton

        return silu_and_mul_triton(x, half)
    gate, up = x.split(half, dim=-1)
    return F.silu(gate) * up


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, *, backend: str = "auto"
                 ) -> torch.Tensor:
    """``silu_and_mul(x @ weight.T)``: ``x`` [T, K], ``weight`` [2 I, K] (gate's
    rows, then up's), result [T, I]. On CUDA one Triton kernel computes each
    output tile's gate and up columns together and applies the gate as it
    stores, the [T, 2 I] projection never written; the roundings are the unfused
    ops' (the projection's output, silu, the product), the sums' order the
    kernel's own."""
    if use_triton(x, backend) and x.shape[0] > 0:
        from formcast.engine.kernels.activation_triton import gate_up_silu_triton

        return gate_up_silu_triton(x, weight)[1]
    return silu_and_mul(F.linear(x, weight), backend="torch")


def add_norm_gate_up_silu(x: torch.Tensor, addend: torch.Tensor, norm_weight: torch.Tensor,
                          eps: float, weight: torch.Tensor, *, backend: str = "auto"
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + addend, gate_up_silu(rms_norm(x + addend), weight))``: a decoder
    layer's residual add, its MLP's input norm, gate|up projection and gate in
    one Triton kernel on CUDA (the normed rows never written), rounding where
    the unfused kernels round (each row's sum of squares in the kernel's order)."""
    if use_triton(x, backend) and x.shape[0] > 0:
        from formcast.engine.kernels.activation_triton import gate_up_silu_triton

        return gate_up_silu_triton(x, weight, (addend, norm_weight, eps))
    total, h = add_rms_norm(x, addend, norm_weight, eps, backend="torch")
    return total, silu_and_mul(F.linear(h, weight), backend="torch")
