"""A GGUF file's key/value metadata, read without touching its tensors.

``gguf.GGUFReader`` builds a numpy view per string of every array, which costs
tens of seconds for a 262k-token vocabulary; the tokenizer needs only the
metadata, so this reads the key/value section straight from the bytes (format
version 2 and 3, little-endian). Values come back as plain Python objects, as
``GGUFReader``'s ``field.contents()`` gives them.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from formcast.engine.errors import CorruptModelError, ModelNotFoundError

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# GGUF value type -> (struct format, numpy dtype) of the fixed-size scalars.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"),
    5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "<u1"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}


class _Cursor:
    """Reads little-endian values from a byte buffer, failing on a short read."""

    def __init__(self, data: bytes | mmap.mmap, source: str) -> None:
        self.data, self.at, self.source = data, 0, source

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.data):
            raise CorruptModelError(f"{self.source}: GGUF metadata ends early (byte {self.at})")
        out = self.data[self.at:self.at + n]
        self.at += n
        return out

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = self.take(self.unpack("<Q"))
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item in _SCALARS:
                dtype = np.dtype(_SCALARS[item][1])
                values = np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype)
                return values.astype(bool).tolist() if item == 7 else values.tolist()
            return [self.value(item) for _ in range(count)]
        if kind in _SCALARS:
            scalar = self.unpack(_SCALARS[kind][0])
            return bool(scalar) if kind == 7 else scalar
        raise CorruptModelError(f"{self.source}: unknown GGUF value type {kind}")


def read_gguf_metadata(path: str | os.PathLike[str], *,
                       keep: Callable[[str], bool] | Iterable[str] | None = None
                       ) -> dict[str, Any]:
    """The metadata of the GGUF file at ``path``. Reads the file; changes nothing.

    Parameters
    ----------
    path : str or path
    keep : callable or iterable of str, optional
        Which keys to return: a predicate on the key, or key prefixes. Every key is
        still parsed (the format has no index), but only these are kept.

    Returns
    -------
    dict
        Key -> value (str, int, float, bool, or a list of them).

    Raises
    ------
    ModelNotFoundError
        No such file.
    CorruptModelError
        Not a GGUF file, an unsupported version, or metadata cut short.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"no GGUF file at {path}")
    if keep is None:
        wanted: Callable[[str], bool] = lambda key: True  # noqa: E731
    elif callable(keep):
        wanted = keep
    else:
        prefixes = tuple(keep)
        wanted = lambda key: key.startswith(prefixes)  # noqa: E731
    with path.open("rb") as f:
        head = f.read(24)
        if len(head) < 24 or head[:4] != _MAGIC:
            raise CorruptModelError(f"{path} is not a GGUF file (bad magic)")
        version, _tensors, count = struct.unpack("<IQQ", head[4:])
        if version not in (2, 3):
            raise CorruptModelError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        # mapped, not read: the metadata sits at the front and the tensors are not needed
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            cursor = _Cursor(data, str(path))
            cursor.at = 24
            out: dict[str, Any] = {}
            for _ in range(count):
                key = cursor.string()
                value = cursor.value(cursor.unpack("<I"))
                if wanted(key):
                    out[key] = value
    return out
