"""The engine's parts through their own interfaces, without a model: the host's
chores, the batched constraint accept, premasking's moving average, row lists."""

from __future__ import annotations

import pytest

from formcast.engine.chores import HostChores
from formcast.engine.constraint_ops import Acceptor, accept_batch
from formcast.engine.pipeline import PipelineStats
from formcast.engine.pipeline.premask import Premasker
from formcast.engine.pipeline.state import without
from formcast.engine.tuning import EngineTuning

from .helpers import AllowOnly, make_seq


class _Blocks:
    """A block manager's deferred hashes, counted."""

    def __init__(self, deferred: int) -> None:
        self.num_deferred = deferred
        self.calls: list[int] = []

    def commit_deferred(self, rows: int) -> None:
        self.calls.append(rows)
        self.num_deferred = max(0, self.num_deferred - rows)


@pytest.mark.parametrize("graves, at_once, looks, left", [
    (10, 3, 0, 10),   # the device idle: nothing dropped
    (10, 3, 1, 7),    # one look while busy: one bite
    (10, 3, 3, 1),
    (10, 3, 9, 0),    # busy past the last grave: all gone, no more looks wanted
    (2, 32, 1, 0),
])
def test_graves_are_dropped_a_bite_at_a_time_while_busy(graves, at_once, looks, left):
    kept = list(range(graves))
    chores = HostChores(_Blocks(0), EngineTuning(graves_at_once=at_once), kept)
    answers = iter([True] * looks + [False])
    chores.bury_while(lambda: next(answers))
    assert len(kept) == left and kept == list(range(left))


@pytest.mark.parametrize("deferred, chore_rows, busy_looks, calls", [
    (0, 16, 5, []),
    (40, 16, 5, [16, 16, 16]),   # drained in three bites
    (40, 16, 1, [16]),           # the device finished after one
])
def test_block_hashes_go_while_the_device_is_busy(deferred, chore_rows, busy_looks, calls):
    blocks = _Blocks(deferred)
    chores = HostChores(blocks, EngineTuning(commit_chore_rows=chore_rows), [])
    answers = iter([True] * busy_looks + [False] * 10)
    chores.commit_while(lambda: next(answers))
    assert blocks.calls == calls


@pytest.mark.parametrize("deferred, quota, calls", [(0, 32, []), (50, 32, [32]), (5, 8, [8])])
def test_a_pipelined_step_hashes_its_quota(deferred, quota, calls):
    blocks = _Blocks(deferred)
    HostChores(blocks, EngineTuning(commit_quota_rows=quota), []).commit_quota()
    assert blocks.calls == calls


class _Failing(AllowOnly):
    def accept(self, token_id: int) -> bool:
        raise RuntimeError("broken")


class _Batched(AllowOnly):
    calls = 0

    @staticmethod
    def accept_tokens(constraints, tokens):
        _Batched.calls += 1
        return [(2 if c.is_terminated() else 1) if c.accept(t) else 0
                for c, t in zip(constraints, tokens)]


@pytest.mark.parametrize("make, tokens, verdicts", [
    (lambda: [AllowOnly({1}), AllowOnly({1})], [1, 2], [1, 0]),
    (lambda: [AllowOnly({1}, length=1), AllowOnly({2})], [1, 2], [2, 1]),
    (lambda: [_Failing({1}), AllowOnly({1})], [1, 1], [-1, 1]),
    (lambda: [_Batched({1}), _Batched({1}, length=1)], [1, 1], [1, 2]),
    (lambda: [_Batched({1}), AllowOnly({3})], [2, 3], [0, 1]),
])
def test_a_batch_accept_gives_each_row_its_verdict(make, tokens, verdicts):
    seqs = []
    for i, constraint in enumerate(make()):
        seq = make_seq([1, 2], rid=f"r{i}")
        seq.constraint = constraint
        seqs.append(seq)
    assert accept_batch(seqs, tokens) == verdicts
    for seq, verdict in zip(seqs, verdicts):
        assert (seq.error is not None) == (verdict == -1)


def test_an_acceptor_checks_a_subset_of_its_rows():
    seqs = []
    for i in range(4):
        seq = make_seq([1, 2], rid=f"r{i}")
        seq.constraint = AllowOnly({5})
        seqs.append(seq)
    acceptor = Acceptor()
    assert acceptor(seqs, [5, 6, 5, 5], [1, 3]) == [0, 1]
    assert acceptor(seqs, [5, 5, 5, 5]) == [1, 1, 1, 1]
    assert [len(s.constraint.accepted) for s in seqs] == [1, 1, 1, 2]


@pytest.mark.parametrize("misses, after, ema, on", [
    ([], 0.5, 0.125, False),
    ([True] * 3, 0.5, 0.125, False),     # a few misses are not yet the rule
    ([True] * 6, 0.5, 0.125, True),
    ([True] * 6 + [False] * 4, 0.5, 0.125, False),
    ([True], 0.5, 1.0, True),             # a weight of 1: the last pick alone
    ([True] * 20, 2.0, 0.125, False),     # above 1: never
])
def test_premasking_follows_a_moving_average_of_misses(misses, after, ema, on):
    premasker = Premasker(None, EngineTuning(premask_after=after, premask_ema=ema),
                          PipelineStats())
    for missed in misses:
        premasker.seen(missed)
    assert premasker.active() is on


@pytest.mark.parametrize("items, drop, expected", [
    ([0, 1, 2, 3], [], [0, 1, 2, 3]),
    ([0, 1, 2, 3], [0], [1, 2, 3]),
    ([0, 1, 2, 3], [1, 3], [0, 2]),
    ([0, 1, 2, 3], [0, 1, 2, 3], []),
    (range(5), [2], [0, 1, 3, 4]),
])
def test_rows_without_some_indices(items, drop, expected):
    assert without(items, drop) == expected
