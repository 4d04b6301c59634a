"""Kernels: one dispatch function per op, a torch reference (the CPU path) and a
Triton kernel for CUDA tensors."""

from __future__ import annotations

import functools
import threading

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
    forward in flight), so it goes through pinned memory, non-blocking. A flat
    list of ints goes through a pinned buffer kept for the purpose
    (:class:`_PinnedLongs`); a pinned tensor made for the call costs more than
    the copy (on the H200's host 87 us for 600 ints, several calls a step)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    if dtype is torch.long and type(values) is list and (not values or type(values[0]) is int):
        staged = _pinned_longs(device).put(values)
        if staged is not None:
            return staged.to(device, non_blocking=True)
    # (made in pinned memory: pin_memory() would copy it there, after asking the
    # driver whether it is pinned already)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class _PinnedLongs:
    """A pinned buffer that lists of ints are written into on their way to the
    device, in two halves used in turn: a half is written again only once the
    copies from its last turn are done (an event recorded on the stream that
    made them as the other half's turn began; thousands of steps later, done
    long since). One per thread and stream (:func:`_pinned_longs`), so the
    event covers every copy made from it."""

    HALF = 1 << 15  # ints a half (256 KB)

    def __init__(self, stream: "torch.cuda.Stream") -> None:
        self.stream = stream
        self.buf = torch.empty(2 * self.HALF, dtype=torch.long, pin_memory=True)
        self.array = self.buf.numpy()
        self.at, self.end = 0, self.HALF  # the free part of the half in use
        self.done: list = [None, None]     # per half: its last turn's copies, done

    def put(self, values: list) -> torch.Tensor | None:
        """``values`` in the buffer (a view of it), or None when too many, or not ints."""
        n = len(values)
        if n > self.HALF:
            return None
        if self.at + n > self.end:
            half = self.end // self.HALF  # (the next one: 1 after 0, 2 % 2 after 1)
            event = torch.cuda.Event()
            event.record(self.stream)
            self.done[half - 1] = event
            half %= 2
            if self.done[half] is not None:
                self.done[half].synchronize()
            self.at, self.end = half * self.HALF, (half + 1) * self.HALF
        start = self.at
        try:
            self.array[start:start + n] = values
        except (TypeError, ValueError, OverflowError):
            return None
        self.at = start + n
        return self.buf[start:start + n]


_PINNED = threading.local()


def _pinned_longs(device: torch.device) -> _PinnedLongs:
    """This thread's buffer for the current stream of ``device``."""
    stream = current_stream(device)
    rings = getattr(_PINNED, "rings", None)
    if rings is None:
        rings = _PINNED.rings = {}
    ring = rings.get(stream.cuda_stream)
    if ring is None:
        ring = rings[stream.cuda_stream] = _PinnedLongs(stream)
    return ring
