"""Paged KV-cache bookkeeping: fixed-size blocks, ref counts and prefix hashes.

Pure Python, no tensors: the model runner owns the cache memory, this module only
decides which block ids each sequence uses. A block holding ``block_size`` computed
tokens gets a hash chained over its whole prefix; a later sequence whose prompt
starts with the same tokens reuses it instead of computing it again. Blocks whose
ref count drops to zero stay hashed in an LRU pool until their memory is needed.

A manager built with a ``window`` serves sliding-window layers (one KV group of
:mod:`formcast.engine.kv_groups`): once no query can see a block any more (all its
positions older than the window, less a margin for rollbacks) it goes back to the
pool, still hashed, and its table entry becomes :data:`NULL_BLOCK`, a block the
pool never hands out (the attention's window mask never reads it). A prefix hit
then needs only the blocks of the window before the hit point (:meth:`window_hit`).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from formcast.engine.sequence import Sequence

NULL_BLOCK = 0  # a windowed pool's table entry for a released block (reserved there)


@dataclass(kw_only=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


def chain_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of a block given the hash of the block before it (None for the first)."""
    return hash((parent, token_ids))


class BlockManager:
    """Allocates KV blocks to sequences; shares full blocks between equal prefixes."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 window: int | None = None, margin: int = 0, free_out_of_window: bool = True):
        """``window``: the sliding window of the layers this manager's blocks serve
        (None: full attention); blocks older than it and ``margin`` more tokens are
        released as the sequence moves on, unless ``free_out_of_window`` is False."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        if window is not None and (window <= 0 or margin < 0 or num_blocks < 2):
            raise ValueError(f"a windowed manager needs window > 0, margin >= 0 and 2 blocks or "
                             f"more, got window={window}, margin={margin}, {num_blocks} blocks")
        self.block_size = block_size
        self.window = window
        self.margin = margin
        self.frees_behind = window is not None and free_out_of_window
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(block_id=i) for i in range(num_blocks)]
        # ref_count == 0 blocks, least recently freed first; hashed ones may be revived
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[int, int] = {}
        # sequences whose full blocks may be unhashed yet (see defer_commits), in order
        self._deferred: dict[Sequence, None] = {}
        self._early_seqs: list[Sequence] | None = None  # the rows open_early went over last
        self._early_at = 0  # and where it stopped
        if window is not None:  # (held for good: released entries point at it)
            self._take(NULL_BLOCK)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------
    def allocate_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks matching the start of a block-less ``seq``.

        Only blocks that end before the last token are reused, so the last token is
        always computed (its logits are needed) and no shared block is ever written.
        Sets ``seq.num_computed_tokens`` and returns the number of reused tokens.
        """
        if seq.block_table:
            raise ValueError(f"sequence {seq.request_id} already has blocks")
        if not self.enable_prefix_caching:
            return 0
        if self._deferred:  # (the blocks of the sequences running are found too)
            self.commit_deferred()
        bs = self.block_size
        parent: int | None = None
        for i in range((len(seq) - 1) // bs):
            ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, ids)
            block_id = self._by_hash.get(h)
            if block_id is None or self.blocks[block_id].token_ids != ids:
                break
            self._take(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
            parent = h
        seq.num_computed_tokens = len(seq.block_table) * bs
        return seq.num_computed_tokens

    def reset_prefix_cache(self) -> int:
        """Forget the cached content of every free block (blocks in use keep theirs),
        so later prompts are computed afresh; returns the number of blocks forgotten."""
        forgotten = 0
        for block_id in self._free:
            block = self.blocks[block_id]
            if block.hash is not None:
                self._forget(block)
                forgotten += 1
        return forgotten

    def _forget(self, block: Block) -> None:
        """Drop ``block``'s cached content (its hash, and the index entry that is its)."""
        if self._by_hash.get(block.hash) == block.block_id:
            del self._by_hash[block.hash]
        block.hash, block.token_ids = None, ()

    # -- growth and release -------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Fresh blocks ``seq`` needs to compute ``num_new_tokens`` more tokens."""
        want = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, want - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self._free)

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give ``seq`` room for ``num_new_tokens`` more computed tokens."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {need}, {len(self._free)} free")
        seq.block_table += self._take_free(need)

    def grow_decode(self, seqs: list[Sequence], ahead: int = 0) -> bool:
        """Room for one more computed token in each of ``seqs`` (a decode step),
        all or none: False, nothing given, when fewer blocks are free than the
        step opens (a row opens one every ``block_size`` steps). ``ahead``: for
        the step that many tokens later (the step after the one in flight, its
        rows assumed to advance). The check is :meth:`blocks_needed` inline: it
        runs for every row of every decode step.

        Rows that start decoding together open their blocks at the same step
        (at 256 rows, 256 blocks at once), so the blocks are taken in one pass
        over the free list's head rather than one :meth:`grow` each (and the
        engine opens most of them before, see :meth:`open_early`)."""
        bs = self.block_size
        opening = [s for s in seqs if s.num_computed_tokens + ahead >= len(s.block_table) * bs]
        if not opening:
            return True
        # (one block a row, but for a row whose table fell behind by more)
        last = ahead + bs  # (blocks_for, inline)
        counts = [(s.num_computed_tokens + last) // bs - len(s.block_table) for s in opening]
        need = sum(counts)
        if need > len(self._free):
            return False
        taken = iter(self._take_free(need))
        for s, count in zip(opening, counts):
            for _ in range(count):
                s.block_table.append(next(taken))
        return True

    def open_early(self, seqs: list[Sequence], rows: int, ahead: int = 1) -> bool:
        """Open the next block of the next ``rows`` of ``seqs`` (round robin from
        where the last call stopped) whose table ends at the block their step
        ``ahead`` tokens on writes in, unless that step starts the block (its
        table entry is then written in that step alone) or free blocks are short
        (fewer than two a sequence would be left). A sequence holds one such
        block at most; it is freed with the rest. Whether rows are left to look
        at before the round comes back (the engine's chore, while the host
        waits for the device: a decode batch's rows open their blocks at the
        same step, 256 rows a quarter of a millisecond of the host's time in
        that step's launch, where :meth:`grow_decode` then finds them open)."""
        n = len(seqs)
        if not n or len(self._free) < 2 * n + rows:
            return False
        bs = self.block_size
        # (the same rows as the last call, compared by identity in C)
        at = self._early_at % n if seqs == self._early_seqs else 0
        self._early_seqs = seqs
        part = seqs[at:at + rows]
        self._early_at = at + len(part)
        due = []
        for s in part:
            pos = s.num_computed_tokens + ahead
            if pos % bs and len(s.block_table) == pos // bs + 1:
                due.append(s)
        if due:
            for s, block_id in zip(due, self._take_free(len(due))):
                s.block_table.append(block_id)
        return self._early_at < n

    def forget_rows(self) -> None:
        """Let go of the rows :meth:`open_early` went over last (a finished
        batch's requests are not kept alive here)."""
        self._early_seqs, self._early_at = None, 0

    def _take_free(self, n: int) -> list[int]:
        """``n`` blocks from the head of the free list (least recently freed),
        their cached content evicted, each now held once (the caller checked
        that that many are free)."""
        take, blocks = self._free.popitem, self.blocks
        ids = []
        for _ in range(n):
            block_id = take(last=False)[0]  # (ref count 0: it leaves the free list)
            block = blocks[block_id]
            if block.hash is not None:  # evict the cached content
                self._forget(block)
            block.ref_count = 1
            ids.append(block_id)
        return ids

    def commit(self, seq: Sequence) -> None:
        """Hash the blocks of ``seq`` that became full of computed tokens."""
        self.commit_many((seq,))

    def commit_many(self, seqs) -> None:
        """:meth:`commit` each of ``seqs``, in one loop: rows that decode together
        fill their blocks at the same step (256 rows: 256 blocks to hash). A
        block counts as full once its tokens are computed and in the sequence's
        token ids (a decode step's token in flight is computed before the host
        has it). A windowed manager then releases the blocks that fell out of
        each one's window (:meth:`release_behind`)."""
        if self.enable_prefix_caching:
            self._hash_full(seqs)
        if self.frees_behind:
            for seq in seqs:
                self.release_behind(seq)

    def _hash_full(self, seqs) -> None:
        """The hashing of :meth:`commit_many`."""
        bs, blocks, by_hash = self.block_size, self.blocks, self._by_hash
        for seq in seqs:
            hashes, table, ids_of = seq.block_hashes, seq.block_table, seq.token_ids
            i = len(hashes)
            end = min(seq.num_computed_tokens, len(ids_of)) // bs
            if end > len(table):
                end = len(table)
            if i >= end:
                continue
            parent = hashes[-1] if hashes else None
            while i < end:
                ids = tuple(ids_of[i * bs:(i + 1) * bs])
                parent = chain_hash(parent, ids)
                hashes.append(parent)
                if parent not in by_hash:
                    block_id = table[i]
                    block = blocks[block_id]
                    if block.hash is None:
                        block.hash, block.token_ids = parent, ids
                        by_hash[parent] = block_id
                i += 1

    def defer_commits(self, seqs) -> None:
        """:meth:`commit_many` of ``seqs`` later: when :meth:`commit_deferred`
        runs (the engine's chores, while the host waits for the device), or
        before a prompt looks up cached blocks or one of them is freed. A
        decode batch's rows fill their blocks at the same step (256 rows: a
        quarter to half a millisecond of hashing on the host, every
        ``block_size`` steps), where the step's launch waited for it."""
        if self.enable_prefix_caching:
            self._deferred.update(dict.fromkeys(seqs))

    def commit_deferred(self, limit: int | None = None) -> bool:
        """Hash the deferred sequences' full blocks, the ``limit`` first of
        them (None: all); whether any are left."""
        deferred = self._deferred
        if limit is None or limit >= len(deferred):
            seqs = list(deferred)
            deferred.clear()
        else:
            seqs = list(itertools.islice(deferred, limit))
            for seq in seqs:
                del deferred[seq]
        self.commit_many(seqs)
        return bool(deferred)

    @property
    def num_deferred(self) -> int:
        """Sequences whose blocks wait to be hashed (:meth:`defer_commits`)."""
        return len(self._deferred)

    def free(self, seq: Sequence) -> None:
        """Release all blocks of ``seq`` (tail first, so shared prefixes live longest)."""
        if self._deferred and seq in self._deferred:  # (cached with their hashes)
            del self._deferred[seq]
            self.commit_many((seq,))
        nulls = self.window is not None
        for block_id in reversed(seq.block_table):
            if not (nulls and block_id == NULL_BLOCK):
                self._release(block_id)
        # (cleared in place: a KV group's table is a list the sequence holds)
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_computed_tokens = 0

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int
             ) -> list[list[tuple[int, int]]]:
        """Give a block-less ``child`` the KV of the first ``num_tokens`` computed tokens
        of ``parent``: the full blocks shared, a partly filled last one copied into a
        fresh block (what the parent holds past ``num_tokens`` there is written over
        by the child, and never read before). Returns the (source, destination) blocks
        to copy, in a list per KV group (one here)."""
        if child.block_table:
            raise ValueError(f"sequence {child.request_id} already has blocks")
        if num_tokens > parent.num_computed_tokens:
            raise ValueError(f"fork of {num_tokens} tokens from {parent.num_computed_tokens} "
                             f"computed")
        full, part = divmod(num_tokens, self.block_size)
        if part and not self._free:
            raise RuntimeError("out of KV blocks: need 1, 0 free")
        for block_id in parent.block_table[:full]:
            if not (self.window is not None and block_id == NULL_BLOCK):
                self._take(block_id)
            child.block_table.append(block_id)
        copies = []
        if part:
            child.block_table += self._take_free(1)
            copies.append((parent.block_table[full], child.block_table[-1]))
        child.num_computed_tokens = num_tokens
        return [copies]

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Forget the KV of every token of ``seq`` from position ``num_tokens`` on."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)
        keep = self.blocks_for(num_tokens)
        nulls = self.window is not None
        for block_id in reversed(seq.block_table[keep:]):
            if not (nulls and block_id == NULL_BLOCK):
                self._release(block_id)
        del seq.block_table[keep:]
        del seq.block_hashes[num_tokens // self.block_size:]
        if num_tokens % self.block_size and seq.block_table:
            # the last kept block is partial again and will be rewritten
            block = self.blocks[seq.block_table[-1]]
            if block.hash is not None:
                if block.ref_count > 1:
                    raise RuntimeError(f"cannot truncate into shared block {block.block_id}")
                self._forget(block)

    # -- sliding windows ----------------------------------------------------------
    def first_needed_block(self, num_tokens: int, margin: int = 0) -> int:
        """The first block a query at position ``num_tokens`` (or up to ``margin``
        positions before it, after a rollback) can see; 0 without a window."""
        if self.window is None:
            return 0
        return max(0, num_tokens - margin - self.window + 1) // self.block_size

    def release_behind(self, seq: Sequence) -> int:
        """Release the blocks of ``seq`` that no query from its next position on
        (less :attr:`margin` for rollbacks) can see; how many were released. Oldest
        first, so the pool evicts them first (they stay hashed until then)."""
        table = seq.block_table
        end = min(self.first_needed_block(seq.num_computed_tokens, self.margin), len(table))
        start = end
        while start > 0 and table[start - 1] != NULL_BLOCK:
            start -= 1
        for i in range(start, end):
            self._release(table[i])
            table[i] = NULL_BLOCK
        return end - start

    def window_held(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether ``seq`` still holds every block a query at ``num_tokens`` sees
        (what a rollback to ``num_tokens`` needs; else it recomputes)."""
        first = self.first_needed_block(num_tokens)
        return NULL_BLOCK not in seq.block_table[first:self.blocks_for(num_tokens)] \
            if self.window is not None else True

    def window_hit(self, seq: Sequence, max_blocks: int) -> int:
        """The most leading blocks, at most ``max_blocks``, that a block-less
        ``seq`` could take from the prefix cache with the window before them
        cached: blocks ``[first_needed_block(h * block_size), h)`` all cached with
        ``seq``'s tokens. Changes nothing (:meth:`attach_window` takes them)."""
        if not self.enable_prefix_caching or max_blocks <= 0:
            return 0
        bs, run, parent = self.block_size, 0, None
        best = 0
        for i in range(max_blocks):
            ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            parent = chain_hash(parent, ids)
            block_id = self._by_hash.get(parent)
            run = run + 1 if block_id is not None and self.blocks[block_id].token_ids == ids else 0
            if run >= i + 1 - self.first_needed_block((i + 1) * bs):
                best = i + 1
        return best

    def attach_window(self, seq: Sequence, num_blocks: int) -> None:
        """Give a block-less ``seq`` its first ``num_blocks`` blocks from the prefix
        cache, the window's (a :meth:`window_hit`), the ones before it as
        :data:`NULL_BLOCK`; sets ``seq.num_computed_tokens``."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.request_id} already has blocks")
        bs, parent = self.block_size, None
        first = self.first_needed_block(num_blocks * bs)
        for i in range(num_blocks):
            ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            parent = chain_hash(parent, ids)
            seq.block_hashes.append(parent)
            if i < first:
                seq.block_table.append(NULL_BLOCK)
                continue
            block_id = self._by_hash.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != ids:
                raise ValueError(f"block {i} of {seq.request_id} is not cached")
            self._take(block_id)
            seq.block_table.append(block_id)
        seq.num_computed_tokens = num_blocks * bs

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count < 0:
            raise RuntimeError(f"block {block_id} released more often than taken")
        if block.ref_count == 0:
            self._free[block_id] = None
