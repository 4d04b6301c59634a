import math

import pytest
import torch

from formcast.engine.constraint import bitmask_words
from formcast.engine.kernels.bitmask import apply_token_bitmask_, unpack_bitmask
from formcast.engine.sampler import Sampler
from formcast.engine.sampling_params import SamplingParams
from formcast.errors import RequestError

from .helpers import AllowOnly, make_seq


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"seed": -1}, "seed"),
    ({"stop": ("",)}, "stop"),
    ({"logprobs": -2}, "logprobs"),
])
def test_sampling_params_reject_bad_values_with_a_named_error(kwargs, match):
    with pytest.raises(RequestError, match=match):
        SamplingParams(**kwargs)


def test_stop_given_as_a_string_becomes_a_tuple():
    assert SamplingParams(stop="\n").stop == ("\n",)


@pytest.mark.parametrize("vocab", [5, 32, 33, 100])
def test_unpack_bitmask_matches_bit_arithmetic(vocab):
    gen = torch.Generator().manual_seed(vocab)
    words = bitmask_words(vocab)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), generator=gen, dtype=torch.int64).to(torch.int32)
    allowed = unpack_bitmask(bitmask, vocab)
    for r in range(3):
        for t in range(vocab):
            assert bool(allowed[r, t]) == bool((int(bitmask[r, t // 32]) >> (t % 32)) & 1)


def test_bitmask_disallows_columns_beyond_its_width():
    logits = torch.zeros(1, 40)
    apply_token_bitmask_(logits, torch.full((1, 1), -1, dtype=torch.int32))
    assert torch.isfinite(logits[0, :32]).all() and torch.isneginf(logits[0, 32:]).all()


def test_bitmask_applies_only_to_listed_rows():
    logits = torch.zeros(3, 8)
    mask = torch.tensor([[0b101]], dtype=torch.int32)
    apply_token_bitmask_(logits, mask, torch.tensor([1]))
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()
    assert torch.isfinite(logits[1]).tolist() == [True, False, True] + [False] * 5


def test_greedy_takes_argmax_and_constraint_redirects_it():
    sampler = Sampler(64, 64)
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    logits[:, 10] = 50.0
    free = make_seq([1], rid="a", temperature=0.0)
    constrained = make_seq([1], rid="b", temperature=0.0)
    constrained.constraint = AllowOnly({3, 40})
    logits[1, 40] = 20.0
    out = sampler(logits, [free, constrained])
    assert out.token_ids == [10, 40] and not out.errors


def test_padded_model_vocabulary_is_never_sampled():
    sampler = Sampler(64, 50)
    logits = torch.zeros(1, 64)
    logits[0, 60] = 100.0
    out = sampler(logits, [make_seq([1], temperature=0.0)])
    assert out.token_ids[0] < 50


def test_seeded_sampling_repeats_and_ignores_other_rows():
    sampler = Sampler(100, 100)
    base = torch.randn(100, generator=torch.Generator().manual_seed(1))

    def draw(batch_rows: int, seed: int) -> list[int]:
        seqs = [make_seq([1], rid=f"s{i}", seed=seed + i, temperature=1.0) for i in range(batch_rows)]
        toks = []
        for _ in range(20):
            logits = base.repeat(batch_rows, 1)
            toks.append(sampler(logits, seqs).token_ids[0])
        return toks

    alone = draw(1, 123)
    assert alone == draw(1, 123)
    assert alone == draw(5, 123)          # row 0 has the same seed; other rows differ
    assert alone != draw(1, 124)


@pytest.mark.parametrize("params, support", [
    ({"top_k": 2}, {0, 1}),
    ({"top_p": 0.6}, {0, 1}),              # 0.5 + 0.25 reaches 0.6
    ({"top_p": 0.4}, {0}),
    ({"min_p": 0.4}, {0, 1}),              # p >= 0.4 * 0.5
])
def test_truncation_keeps_exactly_the_expected_support(params, support):
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
    sampler = Sampler(5, 5)
    seq = make_seq([1], temperature=1.0, seed=7, **params)
    seen = {sampler(probs.log().unsqueeze(0), [seq]).token_ids[0] for _ in range(300)}
    assert seen == support


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    sampler = Sampler(3, 3)
    seq = make_seq([1], temperature=1.0, seed=3)
    n = 3000
    counts = torch.zeros(3)
    for _ in range(n):
        counts[sampler(probs.log().unsqueeze(0), [seq]).token_ids[0]] += 1
    # each frequency within 4 standard deviations of its probability
    for p, c in zip(probs.tolist(), counts.tolist()):
        assert abs(c / n - p) < 4 * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("temperature, invariant", [(0.0, False), (1.0, False), (1.0, True)])
def test_dead_end_and_broken_constraints_fail_only_their_row(temperature, invariant):
    class Broken(AllowOnly):
        def fill_bitmask(self, bitmask, row):
            raise KeyError("boom")

    sampler = Sampler(64, 64, invariant=invariant)
    ok = make_seq([1], rid="ok", temperature=0.0)
    dead = make_seq([1], rid="dead", temperature=temperature, seed=5)
    dead.constraint = AllowOnly(set())
    broken = make_seq([1], rid="broken", temperature=temperature, seed=6)
    broken.constraint = Broken({1})
    logits = torch.zeros(3, 64)
    logits[:, 5] = 1.0
    out = sampler(logits.clone(), [ok, dead, broken])
    assert out.token_ids[0] == 5
    assert "dead end" in out.errors[1] and "boom" in out.errors[2]
    assert out.token_ids[1] == -1 and out.token_ids[2] == -1
    # the same with the masks filled ahead, as the engine does on its worker thread
    filled = sampler.fill_masks([ok, dead, broken])
    assert filled.rows == [1, 2] and "boom" in filled.errors[2]
    again = sampler(logits.clone(), [ok, dead, broken], masks=filled)
    assert again.token_ids == out.token_ids and again.errors == out.errors


def test_logprobs_are_raw_model_logprobs_with_top_alternatives():
    sampler = Sampler(4, 4)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    seq = make_seq([1], temperature=0.0, logprobs=2)
    seq.constraint = AllowOnly({1})
    out = sampler(logits.clone(), [seq])
    expected = torch.log_softmax(logits[0], -1)
    lp = out.logprobs[0]
    assert lp.token_id == 1 and lp.logprob == pytest.approx(float(expected[1]))
    assert [t for t, _ in lp.top] == [0, 1]


def test_banned_tokens_are_excluded_only_at_their_position():
    sampler = Sampler(8, 8)
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 0.0, 0.0, 0.0, 0.0]] * 2)
    seq, other = make_seq([1, 2], temperature=0.0), make_seq([1, 2], rid="o", temperature=0.0)
    seq.banned_tokens = {2: {1, 2}, 3: {3}}   # the next token goes to position 2
    out = sampler(logits.clone(), [seq, other])
    assert out.token_ids == [3, 1] and not out.errors
    seq.banned_tokens = {2: set(range(8))}
    out = sampler(logits.clone(), [seq, other])
    assert 0 in out.errors and out.token_ids[1] == 1


def test_batch_fill_hook_fills_a_class_s_rows_in_one_call_and_falls_back_per_row():
    """With ``batch_fill`` (the engine sets it on CUDA) rows whose constraint class has
    ``fill_bitmasks`` are filled by one call per class, which writes its rows
    whole (they are not cleared for it, unlike the rows a constraint fills
    alone); when that call raises, the rows are cleared and filled one by one so
    only the broken constraint fails."""
    calls = []

    class Batched(AllowOnly):
        @staticmethod
        def fill_bitmasks(constraints, bitmask, rows):
            calls.append(list(rows))
            for c, r in zip(constraints, rows):
                if isinstance(c, Broken):
                    raise KeyError("boom")
                bitmask[r] = 0
                c.fill_bitmask(bitmask, r)

    class Broken(Batched):
        def fill_bitmask(self, bitmask, row):
            raise KeyError("boom")

    seqs = [make_seq([1], rid=f"r{i}", temperature=0.0) for i in range(4)]
    seqs[0].constraint = Batched({3})
    seqs[1].constraint = AllowOnly({4})      # no hook: filled alone
    seqs[3].constraint = Batched({6})
    logits = torch.zeros(4, 64)
    one_by_one = Sampler(64, 64).fill_masks(seqs)
    batched = Sampler(64, 64, batch_fill=True).fill_masks(seqs)
    assert calls == [[0, 2]]                 # mask rows of seqs 0 and 3, one call
    assert batched.rows == one_by_one.rows == [0, 1, 3]
    assert torch.equal(batched.bitmask, one_by_one.bitmask) and not batched.errors
    out = Sampler(64, 64, batch_fill=True)(logits.clone(), seqs, masks=batched)
    assert out.token_ids[:2] == [3, 4] and out.token_ids[3] == 6

    # on a buffer of stale bits: the rows filled alone are cleared first
    def stale(n):
        return torch.full((n, 2), -1, dtype=torch.int32)

    calls.clear()
    assert torch.equal(Sampler(64, 64, batch_fill=True).fill_masks(seqs, stale).bitmask,
                       one_by_one.bitmask) and calls == [[0, 2]]
    seqs[1].constraint = Batched({4})  # one class: one call for every row
    calls.clear()
    every = Sampler(64, 64, batch_fill=True).fill_masks(seqs, stale)
    assert calls == [[0, 1, 2]] and torch.equal(every.bitmask, one_by_one.bitmask)

    seqs[3].constraint = Broken({6})
    filled = Sampler(64, 64, batch_fill=True).fill_masks(seqs, stale)
    assert list(filled.errors) == [3] and "boom" in filled.errors[3]
    assert torch.equal(filled.bitmask[:2], one_by_one.bitmask[:2])


def test_distinct_fill_hook_shares_mask_rows_and_falls_back_when_it_breaks():
    """A constraint class's ``fill_distinct_bitmasks`` fills one mask row per
    state (the engine's usual batch, on CUDA): the filled masks then hold fewer
    rows than constrained rows and say which row each reads; sampling, the
    masked greedy pick and the sampler's other paths read them so. A hook that
    raises, or names rows out of place, is not trusted: the rows are filled as
    without it."""
    broken = []

    class Shared(AllowOnly):
        @staticmethod
        def fill_distinct_bitmasks(constraints, bitmask):
            if broken and isinstance(broken[0], Exception):
                raise broken[0]
            if broken:
                return broken[0]
            states = sorted({frozenset(c.allowed) for c in constraints}, key=sorted)
            for k, state in enumerate(states):
                bitmask[k] = 0
                AllowOnly(set(state)).fill_bitmask(bitmask, k)
            return [states.index(frozenset(c.allowed)) for c in constraints]

    seqs = [make_seq([1], rid=f"r{i}", temperature=0.0) for i in range(5)]
    for seq, allowed in zip(seqs, [{7}, {3}, {7}, {3, 9}, {3}]):
        seq.constraint = Shared(allowed)
    one_by_one = Sampler(64, 64).fill_masks(seqs)
    # (the masks are read by the sampler that filled them, as in the engine: on a
    # machine with CUDA they lie in its pinned buffers, which it tracks)
    sampler = Sampler(64, 64, batch_fill=True)
    filled = sampler.fill_masks(seqs)
    assert filled.shared == [2, 0, 2, 1, 0] and filled.bitmask.shape[0] == 3
    assert torch.equal(filled.bitmask[filled.shared], one_by_one.bitmask)
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    want = [7, 3, 7, 3 if logits[3, 3] >= logits[3, 9] else 9, 3]
    assert sampler(logits.clone(), seqs, masks=filled).token_ids == want
    out = torch.zeros(2, 5, dtype=torch.long)
    rows = torch.arange(5)
    sampler.greedy_masked_(out, logits, rows, rows, sampler.fill_masks(seqs))
    assert out[0].tolist() == want and out[1].tolist() == [0] * 5
    for bad in ([0, 1], [0, 0, 0, 0, 5], RuntimeError("boom")):
        broken[:] = [bad]
        again = Sampler(64, 64, batch_fill=True).fill_masks(seqs)
        assert again.shared is None and not again.errors
        assert torch.equal(again.bitmask, one_by_one.bitmask)


def test_masked_argmax_is_the_max_of_the_masked_logits():
    """The fused greedy pick under a bitmask (torch reference here; the CUDA test
    holds the Triton kernel to it): first maximum among allowed ids below the
    vocabulary cut, the dead-end flag, and agreement with the token ``out`` held."""
    from formcast.engine.constraint import bitmask_words
    from formcast.engine.kernels.bitmask import apply_token_bitmask_, masked_argmax_

    gen = torch.Generator().manual_seed(3)
    vocab = 300
    logits = torch.randn(4, vocab, generator=gen).round(decimals=1)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, bitmask_words(vocab)), generator=gen,
                            dtype=torch.int64).to(torch.int32)
    bitmask[2] = 0
    rows, cols = torch.tensor([3, 1, 0]), torch.tensor([0, 2, 3])
    out = torch.stack((logits.argmax(dim=-1), torch.zeros(4, dtype=torch.long)))
    before = out.clone()
    agree = torch.zeros(3, dtype=torch.bool)
    masked_argmax_(out, logits, bitmask, rows, cols, agree, vocab_size=290, backend="torch")
    masked = logits[rows].clone()
    masked[:, 290:] = float("-inf")
    apply_token_bitmask_(masked, bitmask, backend="torch")
    values, ids = masked.max(dim=-1)
    assert out[0, cols].tolist() == ids.tolist() and out[1, cols].tolist() == [0, 0, 1]
    assert out[:, 1].tolist() == before[:, 1].tolist()          # other columns untouched
    assert agree.tolist() == (ids == before[0, cols]).tolist()
    assert torch.isneginf(values[2])
    # picks whose rows share a mask row read it where it is
    shared = before.clone()
    masked_argmax_(shared, logits, bitmask[[2, 0]], rows, cols, agree, vocab_size=290,
                   mask_rows=torch.tensor([1, 1, 0]), backend="torch")
    again = before.clone()
    masked_argmax_(again, logits, bitmask[[0, 0, 2]], rows, cols, agree, vocab_size=290,
                   backend="torch")
    assert torch.equal(shared, again) and shared[1, cols].tolist() == [0, 0, 1]


def _allow_only_rows():
    seqs = [make_seq([1], rid=f"r{i}", temperature=0.0) for i in range(3)]
    for seq, ok in zip(seqs, [{7}, {3, 4000}, {9}]):
        seq.constraint = AllowOnly(ok)
    return seqs


def test_no_pinned_index_lists_without_a_ring_buffer():
    """The CPU's sampler keeps its masks in no pinned ring buffer: it writes no
    index lists after them (the masked pick copies its lists)."""
    sampler = Sampler(4096, 4096)
    assert sampler.pinned_ints(sampler.fill_masks(_allow_only_rows()), [1, 2]) is None


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA device; none is available here")
def test_masked_picks_read_in_pinned_memory_equal_the_copied_ones():
    """A few masked rows' picks on CUDA read their index lists and masks where
    the host wrote them (pinned memory, after the masks in the sampler's ring
    buffer) instead of from copies: the picks, dead-end flags and agreements are
    those of the copied path, shared mask rows included."""
    class Shared(AllowOnly):
        @staticmethod
        def fill_distinct_bitmasks(constraints, bitmask):
            states = sorted({frozenset(c.allowed) for c in constraints}, key=sorted)
            for k, state in enumerate(states):
                bitmask[k] = 0
                AllowOnly(set(state)).fill_bitmask(bitmask, k)
            return [states.index(frozenset(c.allowed)) for c in constraints]

    vocab = 4096
    seqs = _allow_only_rows()
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, vocab, generator=gen).to(dev)
    for kind, allowed in ((AllowOnly, [{7}, {3, 4000}, set()]), (Shared, [{7}, {3}, {7}])):
        for seq, ok in zip(seqs, allowed):
            seq.constraint = kind(ok)
        sampler = Sampler(vocab, vocab, batch_fill=True)
        got = []
        for pinned in (True, False):
            filled = sampler.fill_masks(seqs)
            rows, cols, shared = [4, 0, 5], [2, 0, 1], filled.shared or []
            values = rows + cols + shared
            ints = sampler.pinned_ints(filled, values) if pinned else \
                torch.tensor(values, device=dev)
            assert ints is not None and ints.is_pinned() == pinned and ints.tolist() == values
            at, where, mask_rows = ints.split([3, 3, len(shared)])
            out = torch.stack((torch.arange(3, device=dev), torch.zeros(3, dtype=torch.long,
                                                                          device=dev)))
            agree = sampler.greedy_masked_(out, logits, at, where, filled,
                                           mask_rows if shared else None, pinned=pinned)
            torch.cuda.synchronize()
            got.append((out.tolist(), agree.tolist()))
        assert got[0] == got[1]
        picks = got[0][0][0]
        for row, col, ok in zip(rows, cols, allowed):
            if ok:
                assert picks[col] == max(ok, key=lambda t: logits[row, t].item())
        if kind is AllowOnly:
            assert got[0][0][1] == [0, 1, 0]  # (the empty mask: a dead end, at its column)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("n", [6, 24])
def test_masked_argmax_on_the_cpu_reads_each_mask_as_masking_every_row(shared, n):
    """The CPU's masked pick, mask row by mask row (a few allowed tokens gathered,
    many masked in one broadcast), against masking every row's logits and taking
    the max: the same picks, dead-end flags and agreement, across masks that
    allow one token, a few, most or none, and rows whose allowed logits are all
    -inf (a dead end too)."""
    from formcast.engine.constraint import bitmask_words
    from formcast.engine.kernels.bitmask import masked_argmax_

    gen = torch.Generator().manual_seed(11)
    vocab = 1000
    words = bitmask_words(vocab)
    logits = torch.randn(n + 2, vocab, generator=gen).round(decimals=1)
    logits[5] = float("-inf")
    allowed = torch.zeros(6, vocab, dtype=torch.bool)
    allowed[0, 17] = True                                            # one token
    allowed[1, torch.randperm(vocab, generator=gen)[:20]] = True     # a few: gathered
    allowed[2] = torch.rand(vocab, generator=gen) < 0.9              # most: broadcast
    allowed[3, 990:] = True                                          # past the cut only
    allowed[4] = True
    bits = torch.zeros(6, words * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.long()
    packed = (bits.view(6, words, 32) << torch.arange(32)).sum(dim=-1)
    masks = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    rows = torch.randperm(n + 2, generator=gen)[:n]
    rows[0] = 5
    cols = torch.randperm(n, generator=gen)
    mask_rows = torch.randint(0, 6, (n,), generator=gen)
    out = torch.stack((logits[:n].argmax(dim=-1), torch.zeros(n, dtype=torch.long)))
    got, agree = out.clone(), torch.zeros(n, dtype=torch.bool)
    if shared:
        masked_argmax_(got, logits, masks, rows, cols, agree, vocab_size=990,
                       mask_rows=mask_rows, backend="torch")
    else:
        masked_argmax_(got, logits, masks[mask_rows], rows, cols, agree, vocab_size=990,
                       backend="torch")
    every = logits[rows, :990].masked_fill(~allowed[mask_rows, :990], float("-inf"))
    values, ids = every.max(dim=-1)
    dead = torch.isneginf(values)
    want = out.clone()
    want[0, cols] = ids.masked_fill(dead, 0)
    want[1, cols] = dead.long()
    assert torch.equal(got, want)
    assert agree.tolist() == (want[0, cols] == out[0, cols]).tolist()
    assert dead[0] and dead[mask_rows == 3].all()                  # -inf row; nothing allowed
    assert set(mask_rows.tolist()) == set(range(6)) or n < 24
