"""The masks of the states one grammar's matchers reach on short texts."""

from __future__ import annotations

import threading

import numpy


class TextMasks:
    """The masks of the states one grammar's matchers reach on short texts, by
    the text: a grammar's state after some bytes depends on those bytes alone,
    not on the tokens that brought them. Owned by its compiled grammar.

    What it buys is a batch's opening. Every row of a batch of one schema is
    masked while the grammar forces its first text ('{"records":[{"name":"'),
    and each step's masks depend on the picks of the step before. With the
    masks of those texts known, a masked pick's verdict is a bit of its text's
    mask, the next mask a copy of a known row, and xgrammar takes the tokens
    on the native worker, off the engine's path. Rows are added as matchers
    fill masks for texts not known yet, up to ``capacity`` (the openings of a
    grammar's answers come first): a batch's fill keeps the masks of its texts
    at once, a single matcher's fill those of texts a fill reached before
    (:meth:`seen_before`). Most texts past an answer's opening are reached
    once, and keeping a mask costs more than a fill: its row is new memory.

    Parameters
    ----------
    words : int
        Width of a mask in int32 words (masks of another width are not kept).
    capacity : int
        Masks kept at most.
    """

    __slots__ = ("slots", "texts", "rows", "words", "capacity", "_lock", "_seen")

    def __init__(self, words: int, capacity: int) -> None:
        self.slots: dict[bytes, int] = {}  # text -> its row in ``rows``
        self.texts: list[bytes] = []       # row -> its text
        self.rows: numpy.ndarray | None = None  # int32 [capacity, words], made on first use
        self.words = words
        self.capacity = capacity
        self._lock = threading.Lock()
        self._seen: set[bytes] = set()  # texts a fill reached, their masks not kept

    @property
    def memory_bytes(self) -> int:
        """What the masks take once made (the compile cache charges it up front)."""
        return self.capacity * self.words * 4

    def row(self, text: bytes | None, words: int) -> int | None:
        """The row of ``text``'s mask, for masks ``words`` wide; None when not known."""
        return self.slots.get(text) if words == self.words else None

    def seen_before(self, text: bytes) -> bool:
        """Whether a fill reached ``text`` before; notes that one has now (of a
        bounded number of texts: past it, those noted before are forgotten)."""
        seen = self._seen
        if text in seen:
            return True
        if len(seen) >= 4 * self.capacity:
            seen.clear()
        seen.add(text)
        return False

    def add(self, text: bytes | None, mask: numpy.ndarray) -> None:
        """Keep ``mask`` (an int32 row) as ``text``'s, while there is room."""
        if text is None or text in self.slots:
            return
        with self._lock:
            at = len(self.slots)
            if len(mask) != self.words or at >= self.capacity or text in self.slots:
                return
            rows = self.rows
            if rows is None or at == len(rows):
                rows = self._grown(at)
            rows[at] = mask
            self.texts.append(text)
            self.slots[text] = at  # (after the row is written: readers take no lock)

    def _grown(self, used: int) -> numpy.ndarray:
        """Room for twice the ``used`` rows (the lock held). The rows grow from a
        few: a grammar that learns few texts never pays for a whole new block of
        ``capacity`` rows, whose every page faults on its first write. A reader
        holding the rows before keeps a valid copy of the rows it knows."""
        rows = numpy.empty((min(self.capacity, max(4, 2 * used)), self.words), dtype=numpy.int32)
        if used:
            rows[:used] = self.rows[:used]
        self.rows = rows
        return rows
