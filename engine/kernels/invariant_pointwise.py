"""Batch-invariant elementwise functions on the CPU.

torch's CPU elementwise kernels run a vector loop and finish the last few
elements of each thread's range with a scalar loop, and for some functions
(``sigmoid``, ``silu``, ``softplus``) the two round differently. Which
elements land in the tail depends on the tensor's size, so a row's bits would
depend on how many rows share the call. :func:`pointwise` fixes what the kernel
sees: the elements, flattened and padded to a multiple of :data:`VECTOR_SPAN`,
go through in slices of at most :data:`SLICE` elements (under torch's grain
size, so one thread each): every element takes the vector path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

VECTOR_SPAN = 64  # a multiple of the vector loop's step (two 512-bit registers of float32)
SLICE = 32768     # torch's grain size: a smaller call runs on one thread


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
              invariant: bool = True) -> torch.Tensor:
    """``fn(x)`` for an elementwise ``fn``; with ``invariant`` on a CPU tensor, each
    element's bits do not depend on ``x``'s size (see the module doc). Other
    devices pass straight through."""
    if not invariant or x.device.type != "cpu" or x.numel() == 0:
        return fn(x)
    flat = x.reshape(-1)
    n = flat.numel()
    size = -(-n // VECTOR_SPAN) * VECTOR_SPAN
    if size != n:
        flat = torch.cat([flat, flat.new_zeros(size - n)])
    if size <= SLICE:
        out = fn(flat)
    else:
        out = torch.cat([fn(flat[i:i + SLICE]) for i in range(0, size, SLICE)])
    return out[:n].view(x.shape)
