"""nn.Linear with CPU float32 shape fixes for the row counts of decoding.

Measured here (MKL sgemm, AVX-512, SmolLM2's linears for one step, distinct
weights so nothing stays in cache):

- 1 to 3 rows run fastest against the weight stored transposed, ``x @ W^T`` with
  ``W^T`` contiguous: 30 ms instead of 44 at 1 row, 47 instead of 76 at 2, 61
  instead of 99 at 3 (from 4 rows on ``F.linear`` wins: 63 ms at 4). So a
  transposed copy of the weight is kept (made on first use, remade if the weight
  changes) and used for those.
- 6, 7, 10, 11, 14 or 15 rows take up to 2x as long as the next multiple of 4
  rows through ``F.linear``, so they are padded with zero rows and the extra
  outputs dropped.

Results per row are unchanged up to float rounding; other devices and dtypes pass
straight through.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

_TRANSPOSED_UP_TO = 3  # rows that run against the transposed copy
_PAD_BELOW = 16  # from 16 rows on, every count runs at full speed


def pad_rows(m: int) -> int:
    """Rows to run a float32 CPU GEMM of ``m`` rows with (through ``F.linear``)."""
    if _TRANSPOSED_UP_TO < m < _PAD_BELOW and m % 4 in (2, 3):
        return m + (-m % 4)
    return m


class Linear(nn.Linear):
    """``nn.Linear`` with the CPU float32 fast paths of the module doc."""

    _transposed: torch.Tensor | None = None
    _transposed_of: tuple[int, int] | None = None  # (data_ptr, version) it was made from

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0] if x.dim() == 2 else 0
        if x.device.type != "cpu" or x.dtype != torch.float32 or \
                self.weight.dtype != torch.float32 or m == 0:
            return F.linear(x, self.weight, self.bias)
        if m <= _TRANSPOSED_UP_TO:
            y = torch.mm(x, self.transposed_weight())
            return y if self.bias is None else y + self.bias
        if pad_rows(m) == m:
            return F.linear(x, self.weight, self.bias)
        padded = torch.zeros(pad_rows(m), x.shape[1], dtype=x.dtype)
        padded[:m] = x
        return F.linear(padded, self.weight, self.bias)[:m]

    def transposed_weight(self) -> torch.Tensor:
        """``weight.T`` contiguous, cached until the weight is replaced or written."""
        w = self.weight
        key = (w.data_ptr(), w._version)
        if self._transposed is None or self._transposed_of != key:
            with torch.no_grad():
                self._transposed = w.detach().t().contiguous()
            self._transposed_of = key
        return self._transposed
