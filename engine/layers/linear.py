"""nn.Linear whose CPU float32 path runs on oneDNN with a prepacked weight.

Two reasons, both measured on the CPUs this runs on (benchmarks/decode_floor.py):

- **Speed at decode row counts.** MKL's sgemm runs one GEMM per row count with a
  different kernel, and for 2 to 16 rows it is far from the memory bound (oneDNN
  with the weight reordered once into its blocked layout is several times faster
  there). Verifying a speculative draft adds rows to a step, so
  what a row costs decides what speculation gains.
- **Row invariance.** oneDNN's kernel computes each output row the same way
  whatever the number of rows from two rows on (a one-row call gets a zero row
  beside it: :func:`formcast.engine.kernels.invariant_matmul.onednn_linear`;
  checked up to 300 rows in tests/engine/test_linear.py),
  where MKL switches kernels at 4 rows and rounds differently. A row's result then
  does not depend on what else runs in the step: greedy outputs do not change with
  the batch or with speculation.

The packed weight is made on first use and remade if the weight is replaced or
written; other devices and dtypes pass straight through ``F.linear``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from formcast.engine.kernels.invariant_matmul import invariant_linear, onednn_linear


def onednn_available() -> bool:
    """Whether torch has the oneDNN (mkldnn) prepacked linear ops on this CPU."""
    return torch.backends.mkldnn.is_available() and \
        hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and \
        hasattr(torch.ops.mkldnn, "_linear_pointwise")


_ONEDNN = onednn_available()
# aten::mm.dtype: a half-precision product accumulated and written in float32 (CUDA)
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")


class Linear(nn.Linear):
    """``nn.Linear`` with the oneDNN float32 CPU path of the module doc."""

    _packed: torch.Tensor | None = None
    _packed_of: tuple[int, int] | None = None  # (data_ptr, version) it was made from
    # CUDA half-precision rows on the fixed-tile Triton GEMM (batch-invariant mode;
    # set by the model runner)
    batch_invariant: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant and x.is_cuda and x.dim() == 2 and \
                x.dtype in (torch.bfloat16, torch.float16) and self.weight.dtype == x.dtype:
            from formcast.engine.kernels.invariant_matmul_triton import invariant_linear_triton

            return invariant_linear_triton(x, self.weight, self.bias)
        if not _ONEDNN or x.device.type != "cpu" or x.dtype != torch.float32 or \
                self.weight.dtype != torch.float32 or x.dim() != 2 or x.shape[0] == 0:
            # (CPU float32 without oneDNN: row tiles keep rows batch-invariant)
            return invariant_linear(x, self.weight, self.bias) if \
                self.weight.dtype == x.dtype else F.linear(x, self.weight, self.bias)
        # (a one-row call gets a zero row beside it: oneDNN's one-row kernel rounds
        # differently from its many-row one)
        return onednn_linear(x, self.packed_weight(), self.bias)

    def forward_float32(self, x: torch.Tensor) -> torch.Tensor:
        """``forward(x).float()``, but on CUDA a bfloat16/float16 ``x`` [N, in] is
        multiplied straight into float32: one GEMM, the accumulator never rounded
        to the half type and no second pass over the output. For a model's head
        that pass is the [N, vocab] conversion of every step."""
        w = self.weight
        if self.batch_invariant and x.is_cuda and x.dim() == 2 and \
                x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype:
            from formcast.engine.kernels.invariant_matmul_triton import invariant_linear_triton

            return invariant_linear_triton(x, w, self.bias, out_dtype=torch.float32)
        if _MM_OUT_DTYPE and x.is_cuda and x.dim() == 2 and self.bias is None and \
                x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype:
            return torch.mm(x, w.t(), out_dtype=torch.float32)
        return self(x).float()

    @property
    def is_packed(self) -> bool:
        """Whether :meth:`packed_weight` made the blocked weight (a float32 CPU forward did)."""
        return self._packed is not None

    def packed_weight(self) -> torch.Tensor:
        """The weight in oneDNN's blocked layout, cached until it is replaced or written."""
        w = self.weight
        key = (w.data_ptr(), w._version)
        if self._packed is None or self._packed_of != key:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
            self._packed_of = key
        return self._packed
