"""Small pieces DeepSeek-V4 uses everywhere: its RMS norms, its interleaved RoPE, and
the matrix product of its batch-invariant mode.

Shapes: ``T`` tokens, ``R`` rotated channels (``qk_rope_head_dim``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from formcast.engine.config import RopeSpec
from formcast.engine.kernels.invariant_matmul import invariant_linear


def dense(x: torch.Tensor, weight: torch.Tensor, invariant: bool) -> torch.Tensor:
    """``x W^T`` for ``x`` [..., K] and ``weight`` [N, K]; with ``invariant`` each row by
    a GEMM whose result does not depend on the number of rows (CPU float32 row tiles,
    the fixed-tile Triton GEMM for CUDA half types; others as ``F.linear``)."""
    if not invariant:
        return F.linear(x, weight)
    flat = x.reshape(-1, x.shape[-1])
    if flat.is_cuda and flat.dtype in (torch.bfloat16, torch.float16) and \
            weight.dtype == flat.dtype and flat.shape[0]:
        from formcast.engine.kernels.invariant_matmul_triton import invariant_linear_triton

        y = invariant_linear_triton(flat, weight)
    else:
        y = invariant_linear(flat, weight)
    return y.view(*x.shape[:-1], weight.shape[0])


class V4RMSNorm(nn.Module):
    """RMS norm with a float32 weight; normalizes and scales in float32, casts once."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm without a weight; the statistic in float32, the product in ``x``'s dtype."""
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)


def rope_inv_freq(spec: RopeSpec, rotary_dim: int) -> torch.Tensor:
    """Inverse frequencies ``[R // 2]`` (float32), YaRN-blended when ``spec.factor`` is set.

    YaRN keeps the fast-rotating pairs as they are (extrapolation), divides the slow
    ones by ``factor`` (interpolation) and ramps linearly in between; the ramp ends
    are the pair indices that turn ``beta_fast`` and ``beta_slow`` times over the
    original context.
    """
    # on the CPU explicitly: models are built under torch.device("meta"), and this
    # table is no parameter that load_weights would fill in afterwards
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu") / rotary_dim
    base_freq = spec.theta ** exponents
    inv_freq = 1.0 / base_freq
    if spec.factor is None:
        return inv_freq
    ctx = spec.original_max_position_embeddings

    def pair_index(rotations: float) -> float:
        return rotary_dim * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(spec.theta))

    low, high = pair_index(spec.beta_fast), pair_index(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # weight of the unscaled frequency
    return (1.0 / (spec.factor * base_freq)) * (1 - keep) + inv_freq * keep


class V4Rotary:
    """Interleaved RoPE on the trailing ``R`` channels of a head (pairs ``(2i, 2i+1)``).

    Plain object (no parameters, no buffers): the frequencies are float32 and follow
    the device of the positions they meet.
    """

    def __init__(self, spec: RopeSpec, rotary_dim: int) -> None:
        self.rotary_dim = rotary_dim
        self.scale = spec.attention_factor
        self._inv_freq = rope_inv_freq(spec, rotary_dim)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[T]`` -> cos, sin ``[T, R // 2]`` in float32."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        angles = positions.float()[:, None] * self._inv_freq
        return angles.cos() * self.scale, angles.sin() * self.scale

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, ..., D]`` by per-token ``cos``/``sin [T, R // 2]`` (pass ``-sin``
        to undo a rotation); the leading ``D - R`` channels pass through."""
        r = self.rotary_dim
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (r // 2,)
        cos, sin = cos.view(shape), sin.view(shape)
        pairs = x[..., -r:].float().unflatten(-1, (r // 2, 2))
        even, odd = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
        return torch.cat((x[..., :-r], rotated.flatten(-2).to(x.dtype)), dim=-1)
