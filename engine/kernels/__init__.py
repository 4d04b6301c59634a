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


_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def current_stream(device: torch.device) -> "torch.cuda.Stream":
    """``torch.cuda.current_stream(device)`` without its argument handling, a
    few microseconds of Python a call, several calls a decode step: the stream
    object is kept while it stays the device's current stream."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream_id, index, device_type = torch._C._cuda_getCurrentStream(index)
    kept = _STREAMS.get(index)
    if kept is None or kept.stream_id != stream_id:
        kept = _STREAMS[index] = torch.cuda.Stream(stream_id=stream_id, device_index=index,
                                                    device_type=device_type)
    return kept


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A list as a tensor on ``device`` without a host sync: a CUDA copy from
    pageable memory waits for the stream to drain (in steady decoding, for the
    forward in flight), so it goes through pinned memory, non-blocking."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    # (made in pinned memory: pin_memory() would copy it there, after asking the
    # driver whether it is pinned already)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
