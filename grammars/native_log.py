"""What native grammar code writes on stderr, caught and handed back as text.

xgrammar's C++ code logs its warnings ("multipleOf is not supported ...; ignoring
multipleOf", "'$' ... is ignored") straight onto file descriptor 2, where Python's
``warnings`` machinery and ``sys.stderr`` redirection never see them. While a compile
runs, :meth:`NativeLog.capture` points descriptor 2 at a temporary file and returns
the library's log lines to the caller, which surfaces them with ``warnings.warn``.

Descriptor 2 belongs to the whole process, so there is one :class:`NativeLog`
(:func:`native_log`) and overlapping captures share one redirection: the first to
open it points descriptor 2 at the file, the last to close it points it back. Each
capture reads the lines written while it was open (a compile that overlaps another
may also see the other's lines). Whatever else reached descriptor 2 meanwhile
(another thread's output) is not a library log line: it is written back to the real
stderr when the redirection ends, late but not lost.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import IO

# xgrammar's log prefix: "[07:22:48] /project/cpp/json_schema_converter.cc:1094: "
_LOG_LINE = re.compile(r"^\[\d\d:\d\d:\d\d\] \S+\.(?:cc|h|cpp):\d+: (?:Warning: )?(.*)$")


class NativeLog:
    """Redirects file descriptor 2 while any capture is open (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = 0
        self._file: IO[bytes] | None = None
        self._saved_fd = -1

    @contextmanager
    def capture(self) -> Iterator[list[str]]:
        """Collect the native library's log lines written inside the block.

        Yields a list that is filled, when the block ends, with each log line's
        message (its time and source-file prefix removed). Changes descriptor 2 for
        the block's duration.
        """
        lines: list[str] = []
        start = self._enter()
        try:
            yield lines
        finally:
            lines.extend(self._leave(start))

    def _enter(self) -> int:
        with self._lock:
            if self._open == 0:
                sys.stderr.flush()
                self._file = tempfile.TemporaryFile()
                self._saved_fd = os.dup(2)
                os.dup2(self._file.fileno(), 2)
            self._open += 1
            return os.fstat(self._file.fileno()).st_size

    def _leave(self, start: int) -> list[str]:
        with self._lock:
            file = self._file
            if file is None:      # unbalanced: nothing was captured for this block
                return []
            fd = file.fileno()
            written = os.pread(fd, os.fstat(fd).st_size - start, start)
            self._open -= 1
            if self._open == 0:
                sys.stderr.flush()
                os.dup2(self._saved_fd, 2)
                os.close(self._saved_fd)
                everything = os.pread(fd, os.fstat(fd).st_size, 0)
                file.close()
                self._file = None
                others = [line for line in everything.splitlines(keepends=True)
                          if not _LOG_LINE.match(line.decode("utf-8", "replace"))]
                if others:
                    os.write(2, b"".join(others))
        found = (_LOG_LINE.match(line) for line in
                 written.decode("utf-8", "replace").splitlines())
        return [m.group(1).strip() for m in found if m is not None]


@cache
def native_log() -> NativeLog:
    """The process's one :class:`NativeLog` (descriptor 2 is the process's)."""
    return NativeLog()
