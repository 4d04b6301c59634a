import pytest

from formcast.engine.block_manager import BlockManager

from .helpers import make_seq


def test_grow_allocates_whole_blocks_and_free_returns_them():
    bm = BlockManager(8, 4)
    seq = make_seq(list(range(10)))
    assert bm.blocks_needed(seq, 10) == 3
    bm.grow(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    seq.num_computed_tokens = 10
    assert bm.blocks_needed(seq, 2) == 0      # 12 tokens still fit in 3 blocks
    assert bm.blocks_needed(seq, 3) == 1
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 8


def test_grow_beyond_capacity_raises_and_can_grow_says_so():
    bm = BlockManager(2, 4)
    seq = make_seq(list(range(9)))
    assert not bm.can_grow(seq, 9)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.grow(seq, 9)
    assert bm.num_free_blocks == 2


def test_grow_decode_opens_a_block_only_at_a_boundary_and_is_all_or_none():
    bm = BlockManager(3, 4)
    full, partial = make_seq(list(range(4)), rid="a"), make_seq(list(range(3)), rid="b")
    for seq in (full, partial):
        bm.grow(seq, len(seq.token_ids))
        seq.num_computed_tokens = len(seq.token_ids)
    assert bm.num_free_blocks == 1
    assert bm.grow_decode([full, partial])  # only the full block's row opens one
    assert (len(full.block_table), len(partial.block_table), bm.num_free_blocks) == (2, 1, 0)
    full.num_computed_tokens, partial.num_computed_tokens = 8, 4
    assert not bm.grow_decode([full, partial])  # both open one, none is free: neither grows
    assert (len(full.block_table), len(partial.block_table)) == (2, 1)


def test_grow_decode_ahead_makes_room_for_the_step_after():
    """``ahead=1``: the step after the one in flight (whose block is there)."""
    bm = BlockManager(4, 4)
    a, b = make_seq(list(range(3)), rid="a"), make_seq(list(range(2)), rid="b")
    for seq in (a, b):
        bm.grow(seq, len(seq.token_ids) + 1)  # (the step in flight's position)
        seq.num_computed_tokens = len(seq.token_ids)
    assert bm.grow_decode([a, b], ahead=1)  # a's next position (4) opens a block, b's (3) not
    assert (len(a.block_table), len(b.block_table), bm.num_free_blocks) == (2, 1, 1)
    a.num_computed_tokens = b.num_computed_tokens = 4
    assert bm.grow_decode([a, b])  # the advanced rows' step: nothing new for a, b opens one
    assert (len(a.block_table), len(b.block_table), bm.num_free_blocks) == (2, 2, 0)
    assert not bm.grow_decode([a, b], ahead=4)  # both would open one: all or none
    assert (len(a.block_table), len(b.block_table)) == (2, 2)


@pytest.mark.parametrize("prompt_len, expected_hit", [
    (9, 8),    # two full blocks before the last token are shared
    (8, 4),    # the block holding the last token is never shared: it is recomputed
    (4, 0),
    (12, 8),
])
def test_prefix_sharing_reuses_full_blocks_before_the_last_token(prompt_len, expected_hit):
    bm = BlockManager(16, 4)
    a = make_seq(list(range(100, 100 + prompt_len)), rid="a")
    bm.grow(a, prompt_len)
    a.num_computed_tokens = prompt_len
    bm.commit(a)
    b = make_seq(list(range(100, 100 + prompt_len)), rid="b")
    assert bm.allocate_prefix(b) == expected_hit
    assert b.num_computed_tokens == expected_hit
    assert b.block_table == a.block_table[:expected_hit // 4]
    for block_id in b.block_table:
        assert bm.blocks[block_id].ref_count == 2


def test_prefix_sharing_stops_at_first_differing_block():
    bm = BlockManager(16, 4)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], rid="a")
    bm.grow(a, 10)
    a.num_computed_tokens = 10
    bm.commit(a)
    b = make_seq([1, 2, 3, 4, 5, 6, 0, 8, 9, 10], rid="b")
    assert bm.allocate_prefix(b) == 4


def test_reset_prefix_cache_forgets_free_blocks_and_keeps_those_in_use():
    bm = BlockManager(8, 2)
    a = make_seq([1, 2, 3, 4, 5], rid="a")
    b = make_seq([7, 8, 9, 10, 11], rid="b")
    for seq in (a, b):
        bm.grow(seq, 5)
        seq.num_computed_tokens = 5
        bm.commit(seq)
    bm.free(a)                                   # a's blocks are free but still hashed
    assert bm.reset_prefix_cache() == 2          # its two full blocks are forgotten
    assert bm.allocate_prefix(make_seq([1, 2, 3, 4, 5], rid="a2")) == 0
    c = make_seq([7, 8, 9, 10, 11], rid="c")     # b still runs: its prefix is still shared
    assert bm.allocate_prefix(c) == 4
    assert c.block_table == b.block_table[:2]


def test_freed_hashed_blocks_are_revived_then_evicted_lru():
    bm = BlockManager(4, 2)
    a = make_seq([1, 2, 3, 4, 5], rid="a")
    bm.grow(a, 5)
    a.num_computed_tokens = 5
    bm.commit(a)
    cached = a.block_table[:2]
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = make_seq([1, 2, 3, 4, 9], rid="b")
    assert bm.allocate_prefix(b) == 4           # revived from the free pool
    assert b.block_table == cached
    assert bm.num_free_blocks == 2
    bm.free(b)
    # filling the whole cache with other content evicts the cached blocks
    c = make_seq(list(range(50, 58)), rid="c")
    bm.grow(c, 8)
    bm.free(c)
    d = make_seq([1, 2, 3, 4, 9], rid="d")
    assert bm.allocate_prefix(d) == 0


def test_uncomputed_blocks_are_not_hashed():
    bm = BlockManager(8, 4)
    a = make_seq(list(range(12)), rid="a")
    bm.grow(a, 12)
    a.num_computed_tokens = 5                   # only one block is fully computed
    bm.commit(a)
    assert len(a.block_hashes) == 1
    b = make_seq(list(range(12)), rid="b")
    assert bm.allocate_prefix(b) == 4


def test_prefix_caching_off_shares_nothing():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a = make_seq(list(range(9)), rid="a")
    bm.grow(a, 9)
    a.num_computed_tokens = 9
    bm.commit(a)
    bm.defer_commits([a])                       # (nothing deferred either)
    assert bm.num_deferred == 0 and not bm.commit_deferred()
    b = make_seq(list(range(9)), rid="b")
    assert bm.allocate_prefix(b) == 0


def test_truncate_frees_tail_blocks_and_unhashes_partial_block():
    bm = BlockManager(8, 4)
    a = make_seq(list(range(12)), rid="a")
    bm.grow(a, 12)
    a.num_computed_tokens = 12
    bm.commit(a)
    bm.truncate(a, 6)
    assert len(a.block_table) == 2 and a.num_computed_tokens == 6
    assert len(a.block_hashes) == 1
    assert bm.num_free_blocks == 6
    b = make_seq(list(range(12)), rid="b")
    assert bm.allocate_prefix(b) == 4           # block 2 is partial again: not reusable


def test_double_release_is_detected():
    bm = BlockManager(4, 4)
    a = make_seq([1, 2, 3], rid="a")
    bm.grow(a, 3)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(RuntimeError, match="released more often"):
        bm.free(a)


def test_a_token_in_flight_counts_as_computed_but_is_not_hashed_until_it_is_there():
    bm = BlockManager(8, 4)
    a = make_seq(list(range(7)), rid="a")
    bm.grow(a, 8)
    a.num_computed_tokens = 8   # (the decode step in flight computes the 8th token)
    bm.commit(a)
    assert len(a.block_hashes) == 1             # its ids stop at 7: block 1 is not full yet
    a.token_ids.append(7)
    bm.commit(a)
    assert len(a.block_hashes) == 2


def test_deferred_commits_hash_in_limited_batches_and_before_lookups_and_frees():
    bm = BlockManager(16, 4)
    seqs = [make_seq(list(range(100 * i, 100 * i + 8)), rid=f"s{i}") for i in range(3)]
    for seq in seqs:
        bm.grow(seq, 8)
        seq.num_computed_tokens = 8
    bm.defer_commits(seqs)
    bm.defer_commits(seqs[:1])                  # (once each)
    assert bm.num_deferred == 3 and all(not s.block_hashes for s in seqs)
    assert bm.commit_deferred(limit=2)          # some left
    assert [len(s.block_hashes) for s in seqs] == [2, 2, 0] and bm.num_deferred == 1
    # a prompt's lookup hashes what is left first: the third sequence's blocks are found
    probe = make_seq(list(range(200, 209)), rid="p")
    assert bm.allocate_prefix(probe) == 8 and bm.num_deferred == 0
    # a freed sequence's deferred blocks are hashed as it goes, and stay cached
    late = make_seq(list(range(300, 308)), rid="late")
    bm.grow(late, 8)
    late.num_computed_tokens = 8
    bm.defer_commits([late])
    bm.free(late)
    assert bm.num_deferred == 0
    again = make_seq(list(range(300, 309)), rid="again")
    assert bm.allocate_prefix(again) == 8


def test_open_early_gives_rows_their_next_block_round_robin():
    bm = BlockManager(40, 4)
    # rows' next positions (num_computed + 1): 5 (mid block 1), 8 (starts block 2),
    # 6 with block 2 open already, 2 (mid block 0), 7
    seqs = []
    for k, (computed, blocks) in enumerate([(4, 2), (7, 2), (5, 3), (1, 1), (6, 2)]):
        seq = make_seq(list(range(computed)), rid=f"s{k}")
        bm.grow(seq, blocks * 4)
        seq.num_computed_tokens = computed
        seqs.append(seq)
    before = [len(s.block_table) for s in seqs]
    assert bm.open_early(seqs, rows=2)          # rows 0 and 1: more to look at
    assert bm.open_early(seqs, rows=2)          # rows 2 and 3
    assert not bm.open_early(seqs, rows=2)      # row 4: the round is done
    opened = [len(s.block_table) - b for s, b in zip(seqs, before)]
    # row 1's step starts its block (written then), row 2 holds its next one already
    assert opened == [1, 0, 0, 1, 1]
    assert not bm.open_early(seqs, rows=5)      # a new round: nothing more to open
    assert [len(s.block_table) - b for s, b in zip(seqs, before)] == opened
    # the step after finds the blocks open: only row 1 opens one
    free = bm.num_free_blocks
    for s in seqs:
        s.num_computed_tokens += 1
    assert bm.grow_decode(seqs) and bm.num_free_blocks == free - 1
    for s in seqs:
        bm.free(s)
    assert bm.num_free_blocks == 40


def test_open_early_keeps_two_free_blocks_a_row():
    bm = BlockManager(8, 4)
    seqs = []
    for k in range(3):
        seq = make_seq([1, 2], rid=f"s{k}")
        bm.grow(seq, 4)
        seq.num_computed_tokens = 2
        seqs.append(seq)
    assert bm.num_free_blocks == 5               # < 2 a row (+ the rows asked): none opened
    assert not bm.open_early(seqs, rows=3)
    assert [len(s.block_table) for s in seqs] == [1, 1, 1]


def test_forget_rows_lets_go_of_the_rows_open_early_went_over():
    import gc
    import weakref

    bm = BlockManager(40, 4)
    seqs = [make_seq([1, 2], rid=f"s{k}") for k in range(3)]
    for seq in seqs:
        bm.grow(seq, 4)
        seq.num_computed_tokens = 2
    bm.open_early(seqs, rows=3)
    gone = weakref.ref(seqs[0])
    for seq in seqs:
        bm.free(seq)
    del seq, seqs
    gc.collect()
    assert gone() is not None                   # (held for the next round)
    bm.forget_rows()
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("upto, copied", [(20, True), (16, False), (3, True)])
def test_fork_shares_full_blocks_and_copies_a_partial_one(upto, copied):
    bm = BlockManager(num_blocks=10, block_size=8)
    parent = make_seq(list(range(22)))
    bm.grow(parent, 22)
    parent.num_computed_tokens = 22
    free = bm.num_free_blocks
    child = make_seq(list(range(upto)))
    copies = bm.fork(parent, child, upto)
    full = upto // 8
    assert child.block_table[:full] == parent.block_table[:full]
    assert child.num_computed_tokens == upto
    if copied:
        assert copies == [[(parent.block_table[full], child.block_table[-1])]]
        assert child.block_table[-1] not in parent.block_table
    else:
        assert copies == [[]] and len(child.block_table) == full
    assert bm.num_free_blocks == free - copied
    bm.free(child)          # (the shared blocks stay the parent's)
    assert bm.num_free_blocks == free
    bm.free(parent)
    assert bm.num_free_blocks == 10
    with pytest.raises(ValueError, match="computed"):
        bm.fork(make_seq([1]), make_seq([1]), 5)
