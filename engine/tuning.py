"""The engine's performance knobs: one frozen object, :class:`EngineTuning`.

None of these changes what the engine outputs (the tests hold every variant to
the same tokens); they move work between the host's threads, the device and the
moments the host would otherwise wait. Their defaults are the values measured
best; ``benchmarks/engine_ab.py --tuning name=value`` compares a variant with
them in one process, and docs/performance.md keeps the figures.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True, kw_only=True)
class EngineTuning:
    """Performance knobs of :class:`formcast.engine.Engine` (``EngineConfig.tuning``).

    Parameters
    ----------
    overlap_rows : int
        A step in flight with at least this many unmasked greedy picks has them
        checked by their constraints as soon as they land (the native worker, or
        the accept thread), while the host goes on to the next step.
    async_fill_rows : int
        Masks of at least this many rows are filled ahead on the mask thread while
        a step's unmasked picks are checked; fewer are filled when sampled (a few
        rows' fill costs less than the thread's trips through the interpreter lock).
    pinned_rows : int
        At most this many masked rows a step have their kernel read its index lists
        and masks in pinned host memory (no upload launched).
    picks_whole_row : bool
        A step's masked greedy picks go into a fresh row that their kernel fills
        whole, copying the unmasked picks, rather than into a clone of the graph's
        output (one launch fewer a step).
    first_in_flight_rows : int
        The fewest rows whose batch's first step puts its tokens in flight as a
        pipelined step does.
    uniform_rows : bool
        Sort a batch whose rows are all greedy and constrained (no bans) by their
        masked flags alone, in C-level loops, rather than row by row.
    accept_switch_interval : float
        Seconds: the interpreter's switch interval, at most, while the accept
        thread checks picks (it needs the lock briefly around each native accept).
    premask_after : float
        Premasking is on while the moving average of how often a pick after a risky
        token broke the grammar is at least this (above 1: never).
    premask_ema : float
        The weight of one pick in that moving average, in (0, 1].
    detok_chore_tokens : int | None
        The host's waits for the device detokenize a row's deferred tokens once it
        has this many; None: they do not.
    detok_chore_rows : int
        Rows looked at between checks of whether that wait is over.
    commit_chore_rows : int
        Sequences whose full KV blocks are hashed at a time while the host waits.
    commit_quota_rows : int
        Sequences whose full blocks are hashed, at least, after a pipelined step's
        launches (a host with no wait still drains a batch's blocks in a few steps).
    open_chore_rows : int
        Rows whose next KV block is opened early at a time while the host waits.
    graves_at_once : int
        Ended requests' constraints dropped at a time while the device is busy.
    graves_kept : int
        The most such constraints kept; past it half are dropped at once.
    fold_norms : bool
        On CUDA in bfloat16, fold a Llama model's norm weights into the projections
        after them before graphs are captured (fewer kernels a decode layer).
    graph_copies : int
        Captures of each decode graph size, replayed in turn, so that a step's
        outputs survive the next replay.
    prefill_graph_min_rows : int
        The smallest padded token count of a captured prompt step.
    prefill_graph_max_tokens : int
        The largest prompt step served by captured graphs.
    mask_ring_spare_rows : int
        Rows of a pinned mask buffer past its masks (see ``Sampler.pinned_ints``).
    few_masks : int
        On the CPU, at most this many picks with a mask row each are masked mask
        by mask rather than in one pass.
    few_allowed : int
        A mask allowing at most one token in this many has its tokens gathered
        rather than the whole row masked.
    lookup_text_window : int
        Tokens of context that prompt lookup searches by text.
    lookup_text_tries : int
        Text matches prompt lookup tries per tail.
    lookup_text_bytes : int
        Bytes of continuation prompt lookup tokenizes per match.
    """

    overlap_rows: int = 128
    async_fill_rows: int = 16
    pinned_rows: int = 16
    picks_whole_row: bool = True
    first_in_flight_rows: int = 8
    uniform_rows: bool = True
    accept_switch_interval: float = 2e-4
    premask_after: float = 0.5
    premask_ema: float = 0.125
    detok_chore_tokens: int | None = 32
    detok_chore_rows: int = 8
    commit_chore_rows: int = 16
    commit_quota_rows: int = 32
    open_chore_rows: int = 32
    graves_at_once: int = 32
    graves_kept: int = 2048
    fold_norms: bool = True
    graph_copies: int = 2
    prefill_graph_min_rows: int = 16
    prefill_graph_max_tokens: int = 8192
    mask_ring_spare_rows: int = 2
    few_masks: int = 8
    few_allowed: int = 16
    lookup_text_window: int = 1024
    lookup_text_tries: int = 4
    lookup_text_bytes: int = 64

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "bool":
                if not isinstance(value, bool):
                    raise ValueError(f"tuning.{f.name} must be a bool, got {value!r}")
                continue
            if value is None and f.name == "detok_chore_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"tuning.{f.name} must be a number, got {value!r}")
            if f.type == "int" and not isinstance(value, int):
                raise ValueError(f"tuning.{f.name} must be an int, got {value!r}")
            if f.name == "premask_after":
                if value < 0:
                    raise ValueError(f"tuning.premask_after must be >= 0, got {value}")
            elif f.name == "premask_ema":
                if not 0 < value <= 1:
                    raise ValueError(f"tuning.premask_ema must be in (0, 1], got {value}")
            elif value <= 0 and f.name not in ("overlap_rows", "async_fill_rows", "pinned_rows",
                                               "first_in_flight_rows"):
                raise ValueError(f"tuning.{f.name} must be positive, got {value}")
            elif value < 0:
                raise ValueError(f"tuning.{f.name} must be >= 0, got {value}")
        if self.graph_copies < 2:
            raise ValueError(f"tuning.graph_copies must be at least 2 (a step's outputs live "
                             f"through the next replay), got {self.graph_copies}")

    @classmethod
    def parse(cls, specs: list[str], base: "EngineTuning | None" = None) -> "EngineTuning":
        """``base`` (default: the defaults) with ``name=literal`` specs replaced,
        as benchmarks take them on the command line.

        Raises
        ------
        ValueError
            An unknown name, a value that is not a Python literal, or one out of range.
        """
        import ast
        import dataclasses

        names = {f.name for f in fields(cls)}
        changes = {}
        for spec in specs:
            name, _, text = spec.partition("=")
            if name not in names:
                raise ValueError(f"tuning {spec!r}: EngineTuning has no field {name!r}; "
                                 f"fields: {', '.join(sorted(names))}")
            try:
                changes[name] = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                raise ValueError(f"tuning {spec!r}: the value is not a Python literal") from None
        return dataclasses.replace(base or cls(), **changes)
