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
