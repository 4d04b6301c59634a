"""SwiGLU's gate: ``silu(gate) * up`` of a fused gate|up projection, in one pass.

``x`` [T, 2 I] holds the gate in its first half and up in its second; the result
is [T, I] in ``x``'s dtype. The torch path is the reference (and the CPU's): silu
rounds to the dtype, then the product does, as the two unfused ops round. The
Triton kernel on CUDA rounds the same way in one launch instead of two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from formcast.engine.kernels import use_triton


def silu_and_mul(x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    half = x.shape[-1] // 2
    if use_triton(x, backend) and x.shape[0] > 0:
        from formcast.engine.kernels.activation_triton import silu_and_mul_triton

        return silu_and_mul_triton(x, half)
    gate, up = x.split(half, dim=-1)
    return F.silu(gate) * up
