"""nn.Linear with a CPU shape fix: row counts the float32 GEMM handles badly are padded.

On the CPU (MKL / oneDNN sgemm, measured here on AVX-512), a decode-sized matmul
with 2, 3, 6, 7, 10 or 11 rows takes up to 2.5x as long as one with the next
multiple of 4 rows (SmolLM2's linears for one step: 44 ms at 1 row, 78 ms at 2,
63 ms at 4). Verification steps of speculative decoding (1 + draft rows) and
small decode batches hit exactly those sizes, so such inputs are padded with zero
rows to the next multiple of 4 and the extra outputs dropped. Results per row are
unchanged up to float rounding; other devices and dtypes pass straight through.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

_PAD_BELOW = 16  # from 12 rows on, every count runs at full speed


def pad_rows(m: int) -> int:
    """Rows to run a float32 CPU GEMM of ``m`` rows with."""
    if 1 < m < _PAD_BELOW and m % 4 in (2, 3):
        return m + (-m % 4)
    return m


class Linear(nn.Linear):
    """``nn.Linear`` whose CPU float32 forward pads awkward row counts (see module doc)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0] if x.dim() == 2 else 0
        if x.device.type != "cpu" or x.dtype != torch.float32 or pad_rows(m) == m:
            return F.linear(x, self.weight, self.bias)
        padded = torch.zeros(pad_rows(m), x.shape[1], dtype=x.dtype)
        padded[:m] = x
        return F.linear(padded, self.weight, self.bias)[:m]
