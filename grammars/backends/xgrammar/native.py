"""The native accept worker (``native_accept.c``): a thread outside the
interpreter that offers a step's tokens to their xgrammar matchers as soon as
they land in host memory.

The library is built on first use with the system's C compiler against the
installed tvm-ffi's headers, cached under ``$FORMCAST_CACHE_DIR/native`` (default
``~/.cache/formcast/native``), keyed by its source and tvm-ffi's version, and
loaded through ctypes. Without a compiler, or when the build or the load fails,
:func:`worker` is None and callers take their Python path
(:func:`unavailable_reason` says why).
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

QUEUED, DONE, SLOW, DEAD, ERROR = 1, 2, 3, 4, 5

_SOURCE = Path(__file__).with_name("native_accept.c")


class Job(ctypes.Structure):
    """One step's accept, as ``fc_job`` in the C source (same field order)."""

    _fields_ = [
        ("fn", ctypes.c_void_p),
        ("handles", ctypes.c_void_p),
        ("host", ctypes.c_void_p),
        ("stride", ctypes.c_int64),
        ("cols", ctypes.c_void_p),
        ("n", ctypes.c_int32),
        ("vocab", ctypes.c_int64),
        ("special", ctypes.c_void_p),
        ("query", ctypes.c_void_p),
        ("query_arg", ctypes.c_void_p),
        ("not_ready", ctypes.c_int32),
        ("poll_pauses", ctypes.c_int32),
        ("verdicts", ctypes.c_void_p),
        ("error", ctypes.c_char * 480),
        ("state", ctypes.c_int32),
        ("next", ctypes.c_void_p),
    ]


class Checked(Protocol):
    """A submitted job whose outcome its submitter checks later (see :class:`Backlog`)."""

    seq: int
    job: Job

    def finish(self) -> int:
        """Wait for the job and act on its outcome: how many things it failed."""


class Backlog:
    """The jobs submitted to a worker whose outcome has not been checked yet,
    oldest first (the worker takes them in order), numbered as submitted.
    Callers that depend on a job wait for its number (:meth:`settle`)."""

    def __init__(self) -> None:
        self.queue: list[Checked] = []
        self.last = 0      # the number of the last job submitted
        self.settled = 0   # every job up to this number is checked
        self.failures = 0  # what the checked jobs failed so far
        self.lock = threading.Lock()

    def add(self, make: Callable[[int], Checked]) -> int:
        """Queue the job ``make`` submits when given its number: that number."""
        with self.lock:
            self.last += 1
            seq = self.last
            self.queue.append(make(seq))
        return seq

    def settle(self, through: int | None = None, *, done_only: bool = False) -> None:
        """Check the jobs up to number ``through`` (None: all), waiting for the
        worker; ``done_only``: only those the worker is through with, no wait."""
        with self.lock:
            queue = self.queue
            while queue and (through is None or queue[0].seq <= through):
                first = queue[0]
                if done_only and first.job.state == QUEUED:
                    break
                self.failures += first.finish()
                queue.pop(0)
                self.settled = first.seq


class Worker:
    """The loaded library, its thread started, and the backlog of the jobs
    submitted to it that are still to be checked."""

    def __init__(self, lib: ctypes.CDLL, quick: ctypes.PyDLL) -> None:
        self._lib = lib
        self.backlog = Backlog()
        lib.fc_wait.argtypes = [ctypes.c_void_p]
        lib.fc_wait.restype = ctypes.c_int
        # (submitting holds the interpreter lock: a few instructions and a mutex)
        self._submit = quick.fc_submit
        self._submit.argtypes = [ctypes.c_void_p]
        self._submit.restype = None
        self._wait = lib.fc_wait  # (a CDLL call: spins without the interpreter lock)
        self._release = quick.fc_defer_release
        self._release.argtypes = [ctypes.c_void_p]
        self._release.restype = ctypes.c_int
        lib.fc_releases_pending.restype = ctypes.c_int64
        if lib.fc_start() != 0:
            raise OSError("the native accept worker failed to start")
        atexit.register(lib.fc_stop)

    def submit(self, job: Job) -> None:
        """Queue ``job`` (its fields set; the caller keeps it and what it points
        to alive until it has finished)."""
        self._submit(ctypes.addressof(job))

    def defer_release(self, obj) -> bool:
        """Have the worker drop a reference to the tvm-ffi object ``obj`` (taken
        here) between its jobs: when that is the last one, the object's
        destructor runs there rather than on the caller's thread. False when
        the worker has stopped (nothing taken)."""
        return self._release(obj.__chandle__()) == 0

    def releases_pending(self) -> int:
        """References handed to :meth:`defer_release` not dropped yet."""
        return self._lib.fc_releases_pending()

    def wait(self, job: Job) -> int:
        """Wait until ``job`` has finished: its state."""
        state = job.state
        if state != QUEUED:
            return state
        return self._wait(ctypes.addressof(job))


# (one per process: the C library runs one thread, loaded once)
_lock = threading.Lock()
_worker: Worker | None = None
_reason: str | None = None


def worker() -> Worker | None:
    """The native accept worker, built and started on first use; None when this
    machine cannot build or load it (see :func:`unavailable_reason`), or when
    ``FORMCAST_NATIVE_ACCEPT=0``."""
    global _worker, _reason
    if _worker is not None or _reason is not None:
        return _worker
    with _lock:
        if _worker is None and _reason is None:
            if os.environ.get("FORMCAST_NATIVE_ACCEPT", "1") == "0":
                _reason = "turned off by FORMCAST_NATIVE_ACCEPT=0"
            else:
                try:
                    path = _build()
                    _worker = Worker(ctypes.CDLL(str(path)), ctypes.PyDLL(str(path)))
                except Exception as exc:  # (the Python path serves)
                    _reason = f"{type(exc).__name__}: {exc}"
    return _worker


def started() -> Worker | None:
    """The native accept worker when :func:`worker` has started it, else None
    (never builds or starts it: what only helps a running worker, such as
    handing it objects to release, asks this)."""
    return _worker


def unavailable_reason() -> str | None:
    """Why :func:`worker` is None (after it was asked), else None."""
    return _reason


def _build() -> Path:
    """The library for this source and this tvm-ffi, compiled when not cached."""
    import tvm_ffi

    root = Path(tvm_ffi.__file__).parent
    include, libdir = root / "include", root / "lib"
    if not (include / "tvm" / "ffi" / "c_api.h").is_file() or \
            not (libdir / "libtvm_ffi.so").is_file():
        raise OSError(f"tvm-ffi at {root} has no C headers or library")
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + str(root).encode() +
                         getattr(tvm_ffi, "__version__", "").encode()).hexdigest()[:16]
    cache = Path(os.environ.get("FORMCAST_CACHE_DIR", Path.home() / ".cache" / "formcast"))
    path = cache / "native" / f"native_accept-{key}.so"
    if path.is_file():
        return path
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler (cc) on this machine")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, "-O2", "-shared", "-fPIC", "-pthread", "-I", str(include), str(_SOURCE),
             "-o", tmp, "-L", str(libdir), "-ltvm_ffi", f"-Wl,-rpath,{libdir}"],
            capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise OSError(f"compiling {_SOURCE.name} failed: {done.stderr.strip()[:400]}")
        os.replace(tmp, path)  # (atomic: another process may build it at once)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
