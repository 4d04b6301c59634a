"""Kernels: one dispatch function per op, a torch reference (the CPU path) and a
Triton kernel for CUDA tensors."""

from __future__ import annotations

import functools

import torch


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(x: torch.Tensor, backend: str) -> bool:
    """Whether an op on ``x`` runs its Triton kernel under ``backend`` ("auto":
    for CUDA tensors when Triton is installed, "torch", "triton")."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown backend {backend!r}: use 'auto', 'torch' or 'triton'")
    if backend == "triton":
        return True
    return backend == "auto" and x.is_cuda and triton_available()
