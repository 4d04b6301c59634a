"""Gated MLP activations of a fused gate|up projection, in one pass: SwiGLU's
``silu(gate) * up`` and GeGLU's ``gelu_tanh(gate) * up`` (Gemma's
``gelu_pytorch_tanh``).

``x`` [T, 2 I] holds the gate in its first half and up in its second; the result
is [T, I] in ``x``'s dtype. The torch path is the reference (and the CPU's): the
activation rounds to the dtype, then the product does, as the two unfused ops round. The
Triton kernel on CUDA rounds the same way in one launch instead of two.

``scale_by`` [T, E] (with ``eps``): each row of ``x`` is first scaled by the
inverse root mean square of that row of ``scale_by`` and rounded to the dtype,
as a norm without weight before the projection would have scaled its input.
That is the layer of a model whose norm weights were folded into the
projection (see ``LlamaForCausalLM.fold_norms``): the norm's kernel goes, its
reduction done here, where its row is read anyway.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from formcast.engine.kernels import use_triton
from formcast.engine.kernels.rmsnorm import scale_rows


def silu_and_mul(x: torch.Tensor, *, scale_by: torch.Tensor | None = None, eps: float = 0.0,
                 backend: str = "auto") -> torch.Tensor:
    half = x.shape[-1] // 2
    if scale_by is not None and scale_by.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"silu_and_mul: rows to scale by {tuple(scale_by.shape)} do not match "
                         f"the input's {tuple(x.shape)}")
    if use_triton(x, backend) and x.shape[0] > 0:
        from formcast.engine.kernels.activation_triton import silu_and_mul_triton

        return silu_and_mul_triton(x, half, scale_by, eps)
    if scale_by is not None:
        x = scale_rows(x, scale_by, eps)
    gate, up = x.split(half, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` of ``x`` [T, 2 I] (gate first)."""
    half = x.shape[-1] // 2
    if use_triton(x, backend) and x.shape[0] > 0:
        from formcast.engine.kernels.activation_triton import gelu_tanh_and_mul_triton

        return gelu_tanh_and_mul_triton(x, half)
    gate, up = x.split(half, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
