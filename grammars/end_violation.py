"""Why a finished document failed its end check (no torch, so constraint checks stay light)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class EndViolation:
    """Why a finished document failed its end check.

    Attributes
    ----------
    message : str
        What is wrong, with the JSON path of the offending value.
    start : int
        Byte offset in the document from which it must change (e.g. the offending
        value, or a container's closing bracket when something is missing from it).
    """

    message: str
    start: int


EndCheck = Callable[[bytes], EndViolation | None]
