"""RMSNorm."""

from __future__ import annotations

import torch
from torch import nn

from formcast.engine.kernels.rmsnorm import add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back (as Llama does)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, addend: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + addend, norm(x + addend))``: one fused kernel on CUDA."""
        return add_rms_norm(x, addend, self.weight, self.eps)
