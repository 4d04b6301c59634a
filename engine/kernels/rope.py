"""Rotary position embedding (rotate-half layout), applied in place.

``x`` [T, heads, D] (any strides with a contiguous last dimension, e.g. the q|k
part of a fused projection's output) is rotated at ``positions`` [T] with the
float32 ``cos``/``sin`` tables [P, D] (each row two equal halves):
``[x1 c - x2 s, x2 c + x1 s]``, transformers' ``x * cos + rotate_half(x) * sin``.
The torch path is the reference and the CPU's; Triton runs on CUDA tensors.
"""

from __future__ import annotations

import torch

from formcast.engine.kernels import use_triton


def apply_rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Rotate ``x`` in place; returns it."""
    if x.shape[0] == 0:
        return x
    if use_triton(x, backend):
        from formcast.engine.kernels.rope_triton import apply_rope_triton_

        apply_rope_triton_(x, positions, cos, sin)
        return x
    half = x.shape[-1] // 2
    c = cos[positions, :half].unsqueeze(1).to(x.dtype)   # [T, 1, D/2]
    s = sin[positions, :half].unsqueeze(1).to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return x.copy_(rotated)
