"""The decode graphs' host staging: kept from step to step, it must hold exactly
what staging every row afresh would, however rows grow, finish, arrive or move."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

from formcast.engine.cuda_graph import DecodeStaging, graph_ladder

BS, MAX_BLOCKS, ROWS = 4, 12, 16
SCRATCH = 100 * BS


def fresh(seqs, padded: int) -> DecodeStaging:
    """Every row staged from explicit lists, as an ordinary step does."""
    st = DecodeStaging(ROWS, MAX_BLOCKS, block_size=BS, scratch_slot=SCRATCH, pin=False)
    pos = [s.num_computed_tokens for s in seqs]
    st.stage(None, pos, [s.block_table[p // BS] * BS + p % BS for s, p in zip(seqs, pos)],
             [s.block_table[:p // BS + 1] for s, p in zip(seqs, pos)], [p + 1 for p in pos],
             padded)
    return st


def assert_same(kept: DecodeStaging, ref: DecodeStaging, seqs, padded: int) -> None:
    n = len(seqs)
    for name in ("positions", "slots", "lens"):
        np.testing.assert_array_equal(getattr(kept, name)[:padded], getattr(ref, name)[:padded],
                                      err_msg=name)
    for i, s in enumerate(seqs):  # entries attention reads: up to the row's block
        used = s.num_computed_tokens // BS + 1
        np.testing.assert_array_equal(kept.tables[i, :used], ref.tables[i, :used],
                                      err_msg=f"row {i}")
    np.testing.assert_array_equal(kept.tables[n:padded, 0], ref.tables[n:padded, 0])


class Device:
    """What a decode graph's device buffer holds: each step's upload copied, its
    patches scattered into the tables (as the graph does first)."""

    def __init__(self, st: DecodeStaging) -> None:
        self.st = st
        self.buf = st.host.clone()
        self.partial = 0  # steps that copied no table

    def step(self, rows: int) -> None:
        st, m = self.st, self.st.max_rows
        end = st.upload(rows)
        self.partial += end == st.tables_at
        self.buf[:end] = st.host[:end]
        at, p = st.tables_at, st.patches
        self.buf[at:].scatter_(0, self.buf[4 * m:4 * m + p], self.buf[4 * m + p:at])

    def assert_tables(self, seqs, padded: int) -> None:
        tables = self.buf[self.st.tables_at:-1].view(ROWS, MAX_BLOCKS).numpy()
        for i, s in enumerate(seqs):
            used = s.num_computed_tokens // BS + 1
            np.testing.assert_array_equal(tables[i, :used], self.st.tables[i, :used],
                                          err_msg=f"device row {i}")
        np.testing.assert_array_equal(tables[len(seqs):padded, 0],
                                      self.st.tables[len(seqs):padded, 0])


def test_kept_staging_equals_staging_afresh() -> None:
    rng = random.Random(0)
    next_block = iter(range(10**6))
    st = DecodeStaging(ROWS, MAX_BLOCKS, block_size=BS, scratch_slot=SCRATCH, pin=False)

    def new_seq(k: int):
        p = rng.randrange(0, 20)
        return SimpleNamespace(request_id=f"r{k}", num_computed_tokens=p,
                               block_table=[next(next_block) for _ in range(p // BS + 1)])

    seqs = [new_seq(k) for k in range(10)]
    made = 10
    device = Device(st)
    for step in range(300):
        padded = next(b for b in graph_ladder(ROWS) if b >= len(seqs))
        st.stage_seqs(seqs, padded)
        assert_same(st, fresh(seqs, padded), seqs, padded)
        device.step(padded)  # (the tables the graph reads are the host's)
        device.assert_tables(seqs, padded)
        # one decode step on: every row moves a position, opening blocks as it goes
        for s in seqs:
            s.num_computed_tokens += 1
            if s.num_computed_tokens // BS >= len(s.block_table):
                s.block_table.append(next(next_block))
        r = rng.random()
        if r < 0.15 and len(seqs) > 1:      # requests finish
            for _ in range(rng.randrange(1, 3)):
                if len(seqs) > 1:
                    seqs.pop(rng.randrange(len(seqs)))
        elif r < 0.25 and len(seqs) < ROWS:  # a request joins
            seqs.insert(rng.randrange(len(seqs) + 1), new_seq(made))
            made += 1
        elif r < 0.3:                        # an ordinary step cut and regrew a table
            st.invalidate()
            s = rng.choice(seqs)
            keep = s.num_computed_tokens // BS
            s.block_table[keep:] = [next(next_block)]
        elif r < 0.4:                        # a row given its next block early
            s = rng.choice(seqs)              # (its opening writes two entries)
            if len(s.block_table) <= s.num_computed_tokens // BS + 1:
                s.block_table.append(next(next_block))
        if any(s.num_computed_tokens // BS >= MAX_BLOCKS - 1 for s in seqs):
            seqs = [s for s in seqs if s.num_computed_tokens // BS < MAX_BLOCKS - 1] \
                or [new_seq(made)]
            made += 1
    assert device.partial > 150  # most steps copy patches, not tables


def test_staging_ahead_equals_staging_after_the_rows_advance() -> None:
    """What ``stage_seqs(ahead=1)`` writes before the rows advance is what staging
    them afresh after they advanced by a token writes."""
    rng = random.Random(1)
    next_block = iter(range(10**6))
    st = DecodeStaging(ROWS, MAX_BLOCKS, block_size=BS, scratch_slot=SCRATCH, pin=False)
    seqs = []
    for k in range(9):
        p = rng.randrange(0, 20)
        seqs.append(SimpleNamespace(request_id=f"r{k}", num_computed_tokens=p,
                                    block_table=[next(next_block) for _ in range(p // BS + 1)]))
    device = Device(st)
    for step in range(24):
        st.stage_seqs(seqs, 16)  # this step
        device.step(16)
        for s in seqs:  # the block of the step after, grown before it is staged
            if (s.num_computed_tokens + 1) // BS >= len(s.block_table):
                s.block_table.append(next(next_block))
        st.stage_seqs(seqs, 16, ahead=1)
        for s in seqs:
            s.num_computed_tokens += 1
        assert_same(st, fresh(seqs, 16), seqs, 16)
        device.step(16)
        device.assert_tables(seqs, 16)
    assert device.partial >= 40


def test_a_row_without_its_block_is_refused() -> None:
    st = DecodeStaging(ROWS, MAX_BLOCKS, block_size=BS, scratch_slot=SCRATCH, pin=False)
    seq = SimpleNamespace(request_id="r0", num_computed_tokens=BS, block_table=[3])
    with pytest.raises(RuntimeError, match="no KV block allocated for position 4"):
        st.stage_seqs([seq], 1)
