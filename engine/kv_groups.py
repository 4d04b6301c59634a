"""KV cache groups: full-attention and sliding-window layers, each kind its own blocks.

A model's layers fall into groups by their attention window (None: full
attention). Each group has its own pool of KV blocks (its layers' cache tensors)
and each sequence one block table per group: ``seq.block_table`` for the first
group, ``seq.group_tables[g - 1]`` for group ``g``. A sliding group's table keeps
only the blocks its window can still see (the rest are released as the sequence
moves on, see :class:`~formcast.engine.block_manager.BlockManager`), so a
request's memory for those layers is bounded by the window, not the context.

:class:`GroupedBlockManager` drives one
:class:`~formcast.engine.block_manager.BlockManager` per group behind the block
manager's interface, for the scheduler and the engine. A prefix hit takes the
longest prefix that every group has cached: the full group's blocks up to the
hit, a sliding group's blocks of the window before it (released sliding blocks
stay hashed in their pool until evicted). Tokens the full group had cached past
that point are computed again ("replayed"): a sliding layer's keys depend, through
the layers under it, on a receptive field of layers x window tokens, so they
cannot be rebuilt exactly from one window of tokens; a prefix whose window blocks
are cached replays nothing. Where they were evicted, the hit falls back to the
longest prefix whose windows are still cached (the start, at worst) and the rest
is computed again: exact, at the cost of that recompute. (Released window blocks
go to the pool's free list before a finished request's last window does, so the
windows a later prompt can hit are the last to be evicted.)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from formcast.engine.block_manager import NULL_BLOCK, BlockManager
from formcast.engine.sequence import Sequence


@dataclass(frozen=True, kw_only=True)
class KVGroup:
    """Layers that share a block table: their window (None: full attention),
    their indices, and the blocks of their pool."""

    window: int | None
    layers: tuple[int, ...]
    num_blocks: int = 0


def group_layers(windows: tuple[int | None, ...]) -> tuple[KVGroup, ...]:
    """The groups of layers with windows ``windows`` (one per layer): full
    attention first, then one group per window, smallest first; no blocks yet."""
    kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))
    return tuple(KVGroup(window=w, layers=tuple(i for i, x in enumerate(windows) if x == w))
                 for w in kinds)


def window_blocks(window: int, margin: int, block_size: int, lookahead: int) -> int:
    """Most blocks a sequence holds in a sliding group: the window, the rollback
    margin and the tokens a step computes ahead (``lookahead``), block aligned,
    plus the null block's share."""
    return -(-(window + margin + lookahead) // block_size) + 1


def size_groups(groups: tuple[KVGroup, ...], *, layer_block_bytes: int, memory: int,
                num_blocks: int | None, max_num_seqs: int, margin: int, block_size: int,
                lookahead: int, step_tokens: int) -> tuple[KVGroup, ...]:
    """``groups`` with their pools sized. ``num_blocks`` set: that many in each.
    Else from ``memory`` bytes (``layer_block_bytes`` a block of one layer): a
    sliding group gets what ``max_num_seqs`` windows fill (each ``lookahead``
    tokens ahead, and a step's ``step_tokens`` of prompt chunks on top), at most
    its layers' share of the memory; the full group the rest. With no full group
    the sliding groups share all of it by their layers."""
    if num_blocks is not None:
        return tuple(KVGroup(window=g.window, layers=g.layers, num_blocks=num_blocks)
                     for g in groups)
    total_layers = sum(len(g.layers) for g in groups)
    full = [g for g in groups if g.window is None]
    sized, spent = [], 0
    for g in groups:
        if g.window is None:
            continue
        share = memory * len(g.layers) // total_layers // (layer_block_bytes * len(g.layers))
        if full:
            want = max_num_seqs * window_blocks(g.window, margin, block_size, lookahead) \
                + -(-step_tokens // block_size) + 1
            share = min(share, want)
        sized.append(KVGroup(window=g.window, layers=g.layers, num_blocks=max(2, share)))
        spent += sized[-1].num_blocks * layer_block_bytes * len(g.layers)
    for g in full:
        n = max(1, (memory - spent) // (layer_block_bytes * len(g.layers)))
        sized.insert(0, KVGroup(window=None, layers=g.layers, num_blocks=n))
    return tuple(sized)


class _GroupView:
    """A sequence as one of its KV groups sees it: that group's table and hashes,
    the sequence's tokens and computed count (what a BlockManager reads)."""

    __slots__ = ("seq", "block_table", "block_hashes")

    def __init__(self, seq: Sequence, table: list[int]) -> None:
        self.seq = seq
        self.block_table = table
        self.block_hashes: list[int] = []

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids

    @property
    def num_computed_tokens(self) -> int:
        return self.seq.num_computed_tokens

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        self.seq.num_computed_tokens = value

    def __len__(self) -> int:
        return len(self.seq.token_ids)


class GroupedBlockManager:
    """One :class:`BlockManager` per KV group, behind the block manager's interface.

    Parameters
    ----------
    groups : tuple[KVGroup, ...]
        The groups, sized (:func:`size_groups`); the first one's table is
        ``seq.block_table``.
    block_size : int
        Tokens a block.
    enable_prefix_caching : bool
        Share blocks between equal prefixes (every group).
    margin : int
        Positions a rollback may go back without a recompute (sliding groups keep
        that many tokens more than their window).
    free_out_of_window : bool
        Release sliding groups' blocks that left the window (False: keep them to
        the end, for comparison).
    """

    def __init__(self, groups: tuple[KVGroup, ...], block_size: int, *,
                 enable_prefix_caching: bool = True, margin: int = 0,
                 free_out_of_window: bool = True) -> None:
        if not groups:
            raise ValueError("a grouped block manager needs at least one KV group")
        self.groups = groups
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.managers = [BlockManager(g.num_blocks, block_size,
                                      enable_prefix_caching=enable_prefix_caching,
                                      window=g.window, margin=margin,
                                      free_out_of_window=free_out_of_window)
                         for g in groups]
        self.replayed_tokens = 0  # tokens cached by the full group, computed again
        self._views: dict[Sequence, list[Sequence | _GroupView]] = {}

    # -- what the engine reads --------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return sum(m.num_blocks for m in self.managers)

    @property
    def num_free_blocks(self) -> int:
        return sum(m.num_free_blocks for m in self.managers)

    @property
    def num_deferred(self) -> int:
        return 0  # (commits are never deferred here)

    def held_blocks(self, seq: Sequence) -> list[int]:
        """Blocks ``seq`` holds in each group (released window entries not counted)."""
        return [sum(1 for b in v.block_table if not (m.window is not None and b == NULL_BLOCK))
                for m, v in zip(self.managers, self._of(seq))]

    def _of(self, seq: Sequence) -> list[Sequence | _GroupView]:
        """``seq`` as each group sees it (the first group: itself)."""
        views = self._views.get(seq)
        if views is None:
            if len(seq.group_tables) != len(self.groups) - 1:
                seq.group_tables = [[] for _ in self.groups[1:]]
            views = [seq] + [_GroupView(seq, t) for t in seq.group_tables]
            self._views[seq] = views
        return views

    # -- prefix cache -------------------------------------------------------------
    def allocate_prefix(self, seq: Sequence) -> int:
        """The longest prefix of a block-less ``seq`` every group has cached, taken
        (see the module docstring); sets ``seq.num_computed_tokens`` and returns it."""
        views, bs = self._of(seq), self.block_size
        if any(v.block_table for v in views):
            raise ValueError(f"sequence {seq.request_id} already has blocks")
        if not self.enable_prefix_caching:
            return 0
        full = [(m, v) for m, v in zip(self.managers, views) if m.window is None]
        sliding = [(m, v) for m, v in zip(self.managers, views) if m.window is not None]
        hit = (len(seq) - 1) // bs
        full_hit = hit
        for m, v in full:
            full_hit = min(full_hit, m.allocate_prefix(v) // bs)
        hit = full_hit
        while True:  # (each group's best hit at or below the others')
            best = min((m.window_hit(v, hit) for m, v in sliding), default=hit)
            if best == hit:
                break
            hit = best
        for m, v in full:
            m.truncate(v, hit * bs)
        for m, v in sliding:
            m.attach_window(v, hit)
        if full:
            self.replayed_tokens += (full_hit - hit) * bs
        seq.num_computed_tokens = hit * bs
        return seq.num_computed_tokens

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int
             ) -> list[list[tuple[int, int]]]:
        """:meth:`BlockManager.fork` in every group: the blocks to copy, per group."""
        return [m.fork(p, c, num_tokens)[0] for m, p, c in zip(self.managers, self._of(parent),
                                                               self._of(child))]

    # -- growth and release -------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Fresh blocks ``seq`` needs in each group for ``num_new_tokens`` more tokens."""
        return [m.blocks_needed(v, num_new_tokens) for m, v in zip(self.managers, self._of(seq))]

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        return all(m.can_grow(v, num_new_tokens) for m, v in zip(self.managers, self._of(seq)))

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        if not self.can_grow(seq, num_new_tokens):
            raise RuntimeError(f"out of KV blocks for {num_new_tokens} tokens of "
                               f"{seq.request_id}")
        for m, v in zip(self.managers, self._of(seq)):
            m.grow(v, num_new_tokens)

    def grow_decode(self, seqs: list[Sequence], ahead: int = 0) -> bool:
        """Room for ``1 + ahead`` more tokens in each of ``seqs``, all or none."""
        if not all(self.can_grow(s, 1 + ahead) for s in seqs):
            return False
        for s in seqs:
            self.grow(s, 1 + ahead)
        return True

    def open_early(self, seqs: list[Sequence], rows: int, ahead: int = 1) -> bool:
        return False  # (blocks open when the step needs them)

    def reset_prefix_cache(self) -> int:
        """Forget the cached content of every group's free blocks."""
        return sum(m.reset_prefix_cache() for m in self.managers)

    def forget_rows(self) -> None:
        """Nothing kept between batches."""

    def commit(self, seq: Sequence) -> None:
        """Hash ``seq``'s full blocks in every group; sliding groups release what
        left their window."""
        for m, v in zip(self.managers, self._of(seq)):
            m.commit(v)

    def commit_many(self, seqs: Iterable[Sequence]) -> None:
        for seq in seqs:
            self.commit(seq)

    def defer_commits(self, seqs: Iterable[Sequence]) -> None:
        self.commit_many(seqs)  # (at once: the engine's chores defer none here)

    def commit_deferred(self, limit: int | None = None) -> bool:
        return False

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq`` in every group."""
        for m, v in zip(self.managers, self._of(seq)):
            m.free(v)
        self._views.pop(seq, None)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Forget ``seq``'s KV from ``num_tokens`` on. Where a sliding group no
        longer holds the window a query at ``num_tokens`` sees (a rollback past
        the margin), every group forgets everything: the sequence is computed
        again from its start."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        views = self._of(seq)
        target = min(num_tokens, seq.num_computed_tokens)
        if all(m.window_held(v, target) for m, v in zip(self.managers, views)):
            for m, v in zip(self.managers, views):
                m.truncate(v, num_tokens)
            return
        for m, v in zip(self.managers, views):
            m.free(v)
