"""The xgrammar backend's performance knobs, one frozen object."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class XGrammarTuning:
    """How the xgrammar backend trades memory and threads for time.

    None of these change what a matcher allows: outputs are the same for every
    setting. Pass one to :class:`~formcast.grammars.backends.xgrammar.XGrammarBackend`;
    every grammar and matcher it makes reads it.

    Attributes
    ----------
    text_masks : bool
        Keep the masks of the states a grammar's matchers reach on short texts
        and take a batch's masked picks on them, xgrammar checking the tokens
        on the native worker (see :class:`~.text_masks.TextMasks`). Off for
        comparisons.
    text_mask_rows : int
        Masks kept per grammar.
    known_min_rows : int
        Rows (that keep their texts) a batch accept needs before it goes by the
        known masks: a few masked rows among many unmasked ones are taken by
        xgrammar at once, so that a fill needing their state waits on no check.
    text_key_limit : int
        Bytes of text a matcher keeps (states of one grammar are shared by text).
    text_answers_kept : int
        Answers of ``forces_text`` / ``narrow_choice`` kept per grammar, by text.
    fill_threads : int or None
        xgrammar threads for a costly batch fill (None: half the cores, at most
        four: more spend their time in the hand-off).
    fill_parallel_us : float
        One thread's estimated time for a batch fill above which it goes to the threads.
    fill_cheap_us : float
        A threaded fill under this many microseconds a row sends the next to one thread.
    fill_probe : int
        Every this-many threaded fills, one runs on one thread to re-measure.
    compile_threads : int or None
        xgrammar's compiler threads (None: the cores, at most eight).
    poll_pauses : int
        Pauses between two queries of a step's device event by the native worker
        (each query takes the driver's lock, which the engine's launches take too).

    Raises
    ------
    ValueError
        A count below its minimum or a negative time.
    """

    text_masks: bool = True
    text_mask_rows: int = 128
    known_min_rows: int = 16
    text_key_limit: int = 64
    text_answers_kept: int = 4096
    fill_threads: int | None = None
    fill_parallel_us: float = 700.0
    fill_cheap_us: float = 6.0
    fill_probe: int = 16
    compile_threads: int | None = None
    poll_pauses: int = 32

    def __post_init__(self) -> None:
        at_least = {"text_mask_rows": 0, "known_min_rows": 1, "text_key_limit": 0,
                    "text_answers_kept": 1, "fill_probe": 1, "poll_pauses": 0}
        for name, low in at_least.items():
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise ValueError(f"XGrammarTuning.{name} must be an int >= {low}, got {value!r}")
        for name in ("fill_threads", "compile_threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"XGrammarTuning.{name} must be None or an int >= 1, "
                                 f"got {value!r}")
        for name in ("fill_parallel_us", "fill_cheap_us"):
            if getattr(self, name) < 0:
                raise ValueError(f"XGrammarTuning.{name} must be >= 0, got {getattr(self, name)}")

    @property
    def fill_thread_count(self) -> int:
        """``fill_threads``, resolved for this machine."""
        if self.fill_threads is not None:
            return self.fill_threads
        return max(1, min(4, (os.cpu_count() or 2) // 2))

    @property
    def compile_thread_count(self) -> int:
        """``compile_threads``, resolved for this machine."""
        if self.compile_threads is not None:
            return self.compile_threads
        return min(8, os.cpu_count() or 1)
