"""The files of a dataset run: the JSONL of records and its manifest.

The JSONL output is the source of truth. Each record is appended with one
``os.write`` of a complete line on an ``O_APPEND`` descriptor, then fsynced, so a
killed run leaves whole lines only (at worst a torn last line if the OS itself
failed mid-write: :meth:`RecordFile.recover` cuts it away). The manifest, written
atomically next to it, records the parameters that decide the records' content; a
run refuses to resume a file made with different ones.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from formcast.errors import DatasetError, ResumeMismatchError


def canonical_json(value: Any) -> str:
    """The one text of a JSON value: sorted keys, no spaces (dedup key, hashes)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def side_path(output: Path, kind: str) -> Path:
    """``out.jsonl`` -> ``out.<kind>.json`` (the manifest and the summary)."""
    stem = output.name[:-len(".jsonl")] if output.name.endswith(".jsonl") else output.name
    return output.with_name(f"{stem}.{kind}.json")


def write_json_atomic(path: Path, value: Any) -> None:
    """Write JSON through a temporary file and a rename: readers see old or new, never half."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass
class Existing:
    """What a previous run left in the output file.

    Attributes
    ----------
    records : dict[int, dict]
        Record id -> the record's line, parsed.
    truncated_bytes : int
        Bytes of a torn last line that were cut away.
    """

    records: dict[int, dict] = field(default_factory=dict)
    truncated_bytes: int = 0


class RecordFile:
    """Append-only JSONL of records; one complete line per ``write`` (changes the file)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def recover(self, n: int) -> Existing:
        """Cut a torn last line away and read the complete records (changes the file).

        Raises
        ------
        DatasetError
            A complete line is not a record of this run (not JSON, no integer id in
            ``[0, n)``, or an id seen twice): the file is not safe to extend.
        """
        existing = Existing()
        if not self.path.exists():
            return existing
        data = self.path.read_bytes()
        keep = data.rfind(b"\n") + 1
        if keep < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(keep)
                os.fsync(f.fileno())
            existing.truncated_bytes = len(data) - keep
        for number, line in enumerate(data[:keep].splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{self.path}:{number} is not JSON ({exc.msg}); the file "
                                   f"was changed by something else than formcast") from exc
            rid = record.get("id") if isinstance(record, dict) else None
            if not isinstance(rid, int) or isinstance(rid, bool) or not 0 <= rid < n:
                raise DatasetError(f"{self.path}:{number} has no record id in [0, {n})")
            if rid in existing.records:
                raise DatasetError(f"{self.path}:{number} repeats record id {rid}")
            existing.records[rid] = record
        return existing

    def open(self, *, truncate: bool) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0)
        self._fd = os.open(self.path, flags, 0o644)

    def append(self, record: dict) -> None:
        """Append one record as one line: a single write, then fsync."""
        assert self._fd is not None, "open() first"
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        written = os.write(self._fd, line)
        if written != len(line):  # a regular file only writes short when the disk is full
            raise OSError(f"short write to {self.path} ({written} of {len(line)} bytes)")
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def check_manifest(path: Path, params: dict[str, Any]) -> None:
    """Compare a manifest's parameters with this run's (no state change).

    Raises
    ------
    DatasetError
        The manifest is missing or unreadable.
    ResumeMismatchError
        It was written with different parameters; the message names each one.
    """
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))["params"]
    except FileNotFoundError as exc:
        raise DatasetError(f"{path} is missing, so the records next to it cannot be resumed "
                           f"safely; remove the output or pass resume=False (--overwrite) "
                           f"to start over") from exc
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DatasetError(f"cannot read the manifest {path}: {exc}") from exc
    differences = {key: (recorded.get(key), params.get(key))
                   for key in sorted(set(recorded) | set(params))
                   if recorded.get(key) != params.get(key)}
    if differences:
        listed = "; ".join(f"{key}: {_short(old)} in the manifest, {_short(new)} now"
                           for key, (old, new) in differences.items())
        raise ResumeMismatchError(
            f"{path.name} was written with different parameters ({listed}); rerun with the "
            f"same ones to resume, or choose another output (or --overwrite) to start over",
            differences=differences)


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:18] + "..." + text[-18:]
