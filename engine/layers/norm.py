"""RMSNorm, and Gemma's form of it that scales by ``1 + weight``."""

from __future__ import annotations

import torch
from torch import nn

from formcast.engine.kernels.rmsnorm import add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back (as Llama does).

    ``offset``: the norm scales by ``offset + weight`` (Gemma's norms: 1), the
    parameter holding the checkpoint's own ``weight``; the sum is made once per
    weight tensor (in the weight's dtype) and kept.
    """

    def __init__(self, hidden_size: int, eps: float, *, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.offset = offset
        self._scale: tuple[tuple[int, int, torch.dtype], torch.Tensor] | None = None

    def scale(self) -> torch.Tensor:
        """What rows are multiplied by after normalization: ``offset + weight``."""
        w = self.weight
        if not self.offset:
            return w
        key = (w.data_ptr(), w._version, w.dtype)
        if self._scale is None or self._scale[0] != key:
            with torch.no_grad():
                self._scale = key, (w.float() + self.offset).to(w.dtype)
        return self._scale[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.scale(), self.eps)

    def add_forward(self, x: torch.Tensor, addend: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + addend, norm(x + addend))``: one fused kernel on CUDA."""
        return add_rms_norm(x, addend, self.scale(), self.eps)
