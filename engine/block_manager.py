"""Paged KV-cache bookkeeping: fixed-size blocks, ref counts and prefix hashes.

Pure Python, no tensors: the model runner owns the cache memory, this module only
decides which block ids each sequence uses. A block holding ``block_size`` computed
tokens gets a hash chained over its whole prefix; a later sequence whose prompt
starts with the same tokens reuses it instead of computing it again. Blocks whose
ref count drops to zero stay hashed in an LRU pool until their memory is needed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from formcast.engine.sequence import Sequence


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

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(block_id=i) for i in range(num_blocks)]
        # ref_count == 0 blocks, least recently freed first; hashed ones may be revived
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[int, int] = {}

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
        over the free list's head rather than one :meth:`grow` each."""
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

    def _take_free(self, n: int) -> list[int]:
        """``n`` blocks from the head of the free list (least recently freed),
        their cached content evicted, each now held once (the caller checked
        that that many are free)."""
        take, blocks, by_hash = self._free.popitem, self.blocks, self._by_hash
        ids = []
        for _ in range(n):
            block_id = take(last=False)[0]  # (ref count 0: it leaves the free list)
            block = blocks[block_id]
            if block.hash is not None:  # evict the cached content
                if by_hash.get(block.hash) == block_id:
                    del by_hash[block.hash]
                block.hash, block.token_ids = None, ()
            block.ref_count = 1
            ids.append(block_id)
        return ids

    def commit(self, seq: Sequence) -> None:
        """Hash the blocks of ``seq`` that became full of computed tokens."""
        self.commit_many((seq,))

    def commit_many(self, seqs) -> None:
        """:meth:`commit` each of ``seqs``, in one loop: rows that decode together
        fill their blocks at the same step (256 rows: 256 blocks to hash)."""
        if not self.enable_prefix_caching:
            return
        bs, blocks, by_hash = self.block_size, self.blocks, self._by_hash
        for seq in seqs:
            hashes, table, ids_of = seq.block_hashes, seq.block_table, seq.token_ids
            for i in range(len(hashes), min(seq.num_computed_tokens // bs, len(table))):
                ids = tuple(ids_of[i * bs:(i + 1) * bs])
                h = chain_hash(hashes[-1] if hashes else None, ids)
                hashes.append(h)
                block = blocks[table[i]]
                if block.hash is None and h not in by_hash:
                    block.hash, block.token_ids = h, ids
                    by_hash[h] = block.block_id

    def free(self, seq: Sequence) -> None:
        """Release all blocks of ``seq`` (tail first, so shared prefixes live longest)."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Forget the KV of every token of ``seq`` from position ``num_tokens`` on."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)
        keep = self.blocks_for(num_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            self._release(block_id)
        del seq.block_table[keep:]
        del seq.block_hashes[num_tokens // self.block_size:]
        if num_tokens % self.block_size and seq.block_table:
            # the last kept block is partial again and will be rewritten
            block = self.blocks[seq.block_table[-1]]
            if block.hash is not None:
                if block.ref_count > 1:
                    raise RuntimeError(f"cannot truncate into shared block {block.block_id}")
                if self._by_hash.get(block.hash) == block.block_id:
                    del self._by_hash[block.hash]
                block.hash, block.token_ids = None, ()

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
