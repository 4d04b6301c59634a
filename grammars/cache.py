"""A least-recently-used map bounded by the bytes its entries hold.

Holds compiled grammars and compile failures alike (a failure is a small entry), so
a repeated bad constraint fails at lookup instead of compiling again. Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")


@dataclass(frozen=True)
class Failure:
    """A cached compile error: the message to raise again."""

    message: str


class ByteBoundedLRU(Generic[V]):
    """Maps keys to values, evicting the least recently used past ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, tuple[V | Failure, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> V | Failure | None:
        """The entry for ``key`` (marking it recently used), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: Hashable, value: V | Failure, nbytes: int) -> None:
        """Insert or replace; an entry larger than the whole budget is not kept."""
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            if nbytes > self.max_bytes:
                return
            self._entries[key] = (value, nbytes)
            self._bytes += nbytes
            while self._bytes > self.max_bytes:
                _, (_, size) = self._entries.popitem(last=False)
                self._bytes -= size

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def values(self) -> list[V | Failure]:
        """The cached values, least recently used first (a snapshot)."""
        with self._lock:
            return [value for value, _ in self._entries.values()]

    @property
    def nbytes(self) -> int:
        """Bytes currently charged (never a count caught mid-insert, over the budget)."""
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
