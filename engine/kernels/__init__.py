"""Kernels: one dispatch function per op, a torch reference (the CPU path) and a
Triton kernel for CUDA tensors."""

from __future__ import annotations

import functools
import threading

import numpy
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


def wait_event(event: "torch.cuda.Event") -> None:
    """Wait until ``event`` has fired. Asked first: a wait lets go of the
    interpreter lock even for an event long fired (the usual case: a buffer's
    last copy, steps ago), and getting it back waits for any thread that took
    it meanwhile (the accept thread, for up to a switch interval), where a
    query keeps it."""
    if not event.query():
        event.synchronize()


@functools.cache
def _cuda_event_query() -> int | None:
    """The address of the CUDA runtime's ``cudaEventQuery`` as this process
    loaded it (with torch), or None when it is not found."""
    import ctypes
    import os

    names = ["libcudart.so.12", "libcudart.so.13", "libcudart.so"]
    try:  # (the copy torch loaded, wherever it lies)
        with open("/proc/self/maps") as maps:
            names = sorted({line.split()[-1] for line in maps if "/libcudart" in line}) + names
    except OSError:
        pass
    for name in names:
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            return ctypes.cast(lib.cudaEventQuery, ctypes.c_void_p).value
        except (OSError, AttributeError):
            continue
    return None


# cudaErrorNotReady: what cudaEventQuery answers for work not yet done
CUDA_NOT_READY = 600


def event_poll(event: "torch.cuda.Event") -> tuple[int, int, int] | None:
    """How a native thread polls ``event`` (recorded) without the interpreter:
    ``cudaEventQuery``'s address, the event's handle and the code it answers
    until the event fires; None when the runtime's function is not found."""
    query = _cuda_event_query()
    if query is None:
        return None
    return query, event.cuda_event, CUDA_NOT_READY


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A list as a tensor on ``device`` without a host sync: a CUDA copy from
    pageable memory waits for the stream to drain (in steady decoding, for the
    forward in flight), so it goes through pinned memory, non-blocking. Lists
    of integers (a step's row indices) go through a ring of pinned buffers
    (:class:`_PinnedRing`); anything else is made in pinned memory."""
    ints = dtype is torch.long and len(values) > 0 and type(values[0]) is int
    if device.type != "cuda":
        if ints and device.type == "cpu":  # (through numpy: a quarter of torch.tensor's time)
            return torch.from_numpy(numpy.array(values, dtype=numpy.int64))
        return torch.tensor(values, dtype=dtype, device=device)
    if ints and len(values) <= _PinnedRing.SIZE:
        return _PinnedRing.of(device).upload(values)
    # (made in pinned memory: pin_memory() would copy it there, after asking the
    # driver whether it is pinned already)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class _PinnedRing:
    """Pinned host buffers that :func:`to_device` copies integer lists from, in
    turn, each reused once the device has read it (an event a buffer).

    Pinned memory made for every list costs the host tens of microseconds a
    call (the caching host allocator records an event and looks for a free
    block each time); a decode step of constrained rows uploads a few
    such lists. A list is written into the next buffer through its numpy view
    instead, and copied from there."""

    SLOTS = 8
    SIZE = 1 << 16  # integers a buffer holds (longer lists: made in pinned memory)
    _rings: dict[torch.device, "_PinnedRing"] = {}
    _lock = threading.Lock()

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: list[tuple[torch.Tensor, object] | None] = [None] * self.SLOTS
        self.events: list["torch.cuda.Event | None"] = [None] * self.SLOTS
        self.turn = 0

    @classmethod
    def of(cls, device: torch.device) -> "_PinnedRing":
        ring = cls._rings.get(device)
        if ring is None:
            with cls._lock:
                ring = cls._rings.setdefault(device, cls(device))
        return ring

    def upload(self, values) -> torch.Tensor:
        n = len(values)
        with self._lock:  # (engines may run on several threads)
            k = self.turn
            self.turn = (k + 1) % self.SLOTS
            if self.buffers[k] is None:
                with torch.inference_mode(False):  # (a normal tensor, whatever the mode)
                    host = torch.empty(self.SIZE, dtype=torch.long, pin_memory=True)
                self.buffers[k], self.events[k] = (host, host.numpy()), torch.cuda.Event()
            else:
                wait_event(self.events[k])  # (its last copy has read it: long done)
            host, view = self.buffers[k]
            view[:n] = values
            out = torch.empty(n, dtype=torch.long, device=self.device)
            out.copy_(host[:n], non_blocking=True)
            self.events[k].record(current_stream(self.device))
        return out
