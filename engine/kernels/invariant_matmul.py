"""Batch-invariant float32 matrix products on the CPU: a row's result never
depends on how many other rows share the call.

BLAS libraries pick a kernel by the shape of the call. MKL's sgemm takes
different kernels (and reduction orders over the inner dimension) for a few
rows than for many, and oneDNN's packed-weight linear takes a one-row kernel of
its own for wide inner dimensions; the same row then rounds differently alone
and in a batch. Two ways out, both by fixing what the kernel sees:

- :func:`onednn_linear`: oneDNN's blocked GEMM is row-invariant from two rows
  on, so a one-row call gets a zero row beside it.
- :func:`tiled_linear`: any other CPU GEMM runs on whole tiles of
  :data:`ROW_TILE` rows (the last one padded with zeros), one call of the same
  shape per tile: every row goes through the same kernel with the same
  reduction order, in any batch.

Shapes: M rows, K inner, N outputs.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

ROW_TILE = 16
ONEDNN_MIN_ROWS = 2


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
                  ) -> torch.Tensor:
    """``x W^T (+ b)`` on oneDNN's packed weight (``torch.ops.mkldnn._reorder_linear_weight``
    of W [N, K]); ``x`` [M, K] float32 -> [M, N], each row as in any other M."""
    m = x.shape[0]
    y = torch.ops.mkldnn._linear_pointwise(_pad_rows(x, max(m, ONEDNN_MIN_ROWS)), packed, bias,
                                           "none", [], "")
    return y if y.shape[0] == m else y[:m]


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` [M, K], with the rows run in tiles of
    :data:`ROW_TILE` (one batched GEMM of [ROW_TILE, K] x [K, N] per tile), so a
    row's result does not depend on M. Returns [M, N]."""
    m = x.shape[0]
    tiles = -(-m // ROW_TILE)
    xt = _pad_rows(x, tiles * ROW_TILE).view(tiles, ROW_TILE, x.shape[1])
    y = torch.bmm(xt, weight.t().unsqueeze(0).expand(tiles, -1, -1)).view(-1, weight.shape[0])
    y = y[:m]
    return y if bias is None else y + bias


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """``F.linear`` that is row-invariant for CPU float32 2-D inputs (:func:`tiled_linear`);
    other devices, dtypes and shapes pass straight through ``F.linear``."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != x.dtype or \
            x.dim() != 2 or x.shape[0] == 0:
        return F.linear(x, weight, bias)
    return tiled_linear(x, weight, bias)
