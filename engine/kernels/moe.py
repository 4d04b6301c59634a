"""Routed experts of a mixture-of-experts layer: every (token, expert) pair through
its expert's clamped-SwiGLU MLP, weighted, summed per token.

``x`` [T, E]; ``gate_up`` [X, 2I, E] (gate rows first) and ``down`` [X, E, I], the
X experts stacked; ``experts``/``weights`` [T, K] the routing. The torch path is
the reference and the CPU's: pairs grouped by expert, two GEMMs per expert that
has tokens. Triton runs on CUDA: the pairs are sorted by expert and laid out in
tiles of one expert each (on the device, no host sync), one grouped GEMM computes
every tile's gate|up projection and activation, a second its down projection
times the routing weight, and each token sums its K rows (no atomics: the result
does not depend on scheduling).

Batch invariance: on the CPU each expert's GEMMs run in row tiles
(:func:`formcast.engine.kernels.invariant_matmul.invariant_linear`), so a token's
result does not depend on how many others chose its experts, and a token adds
its K rows in expert order; with ``invariant`` the Triton path keeps one tile
height for every batch (otherwise chosen by the number of pairs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from formcast.engine.kernels import use_triton
from formcast.engine.kernels.invariant_matmul import invariant_linear
from formcast.engine.kernels.invariant_pointwise import pointwise


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float,
                   invariant: bool = False) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)``; ``invariant``: the silu by
    :func:`formcast.engine.kernels.invariant_pointwise.pointwise` (row count-free bits)."""
    return pointwise(F.silu, gate.clamp(max=limit), invariant) * up.clamp(min=-limit, max=limit)


def grouped_expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                       experts: torch.Tensor, weights: torch.Tensor, limit: float, *,
                       invariant: bool = False, backend: str = "auto") -> torch.Tensor:
    """``sum_k weights[t, k] * MLP_{experts[t, k]}(x[t])`` -> [T, E] in ``x``'s dtype."""
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    if use_triton(x, backend):
        from formcast.engine.kernels.moe_triton import grouped_expert_mlp_triton

        return grouped_expert_mlp_triton(x, gate_up, down, experts, weights, limit,
                                         invariant=invariant)
    out = torch.zeros_like(x)
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)  # token-slot pairs grouped by expert
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    tokens = order // experts.shape[1]
    slot_weights = weights.flatten()[order]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = tokens[start:start + count]
        gate, up = invariant_linear(x[rows], gate_up[expert]).chunk(2, dim=-1)
        y = invariant_linear(clamped_swiglu(gate, up, limit, invariant), down[expert])
        out.index_add_(0, rows, (y * slot_weights[start:start + count, None]).to(out.dtype))
        start += count
    return out
