"""Speculative decoding pieces without a model: proposers, draft validation, the
config, and the lossless verification rule (chi-square against plain sampling)."""

from __future__ import annotations

import itertools

import pytest
import torch

from formcast.engine.sampler import Sampler, _probs
from formcast.engine.speculative import Draft, PromptLookupProposer, SpecConfig, propose
from formcast.engine.speculative.proposers import DraftMemory, JumpForwardProposer, find_continuation

from .helpers import AllowOnly, make_seq


# ------------------------------------------------------------------ proposers


def test_find_continuation_prefers_the_longest_then_the_most_recent_match():
    ctx = [1, 2, 3, 9, 1, 2, 3, 4, 7, 2, 3]
    assert find_continuation(ctx, 3, 1) == 7   # "2 3" most recently before the suffix -> 4
    assert find_continuation([5, 1, 2, 8, 6, 1, 2], 2, 1) == 3
    assert find_continuation([1, 2, 3], 3, 1) is None
    assert find_continuation([4, 4], 2, 1) == 1
    assert find_continuation([], 3, 1) is None


def test_prompt_lookup_proposes_the_continuation_with_compounding_confidence():
    seq = make_seq([10, 11, 12, 13, 14, 15, 10, 11])
    draft = PromptLookupProposer(3, 1).propose(seq, seq.token_ids, 3)
    assert draft.tokens == [12, 13, 14] and draft.num_forced == 0
    assert draft.confidence == pytest.approx([0.5, 0.25, 0.125])  # no history: rate 1/2
    seq.spec_lookup_proposed, seq.spec_lookup_accepted = 8, 8
    assert PromptLookupProposer(3, 1).propose(seq, seq.token_ids, 1).confidence == \
        pytest.approx([0.9])


class Forcing(AllowOnly):
    def __init__(self, allowed, forced):
        super().__init__(allowed)
        self.forced = forced

    def forced_tokens(self):
        return list(self.forced) if not self.accepted else []  # forced at the start only


def test_draft_is_forced_tokens_then_lookup_cut_at_the_first_rejected_token():
    seq = make_seq([10, 11, 12, 13, 14, 10])
    seq.constraint = Forcing({10, 11, 12, 13}, forced=[11])
    seq.spec_lookup_proposed = seq.spec_lookup_accepted = 100
    cfg = SpecConfig(max_draft=5, min_confidence=0.0)
    proposers = (JumpForwardProposer(), PromptLookupProposer(3, 1))
    draft = propose(seq, cfg, 5, proposers)
    # forced 11, then lookup after "10 11" -> 12 13 14 ...; 14 is not allowed
    assert draft.tokens == [11, 12, 13] and draft.num_forced == 1
    assert draft.confidence[0] == 1.0
    assert seq.constraint.accepted == []  # validation left the matcher as it was
    assert propose(seq, cfg, 1, proposers).tokens == [11]


def test_low_confidence_positions_are_not_verified():
    seq = make_seq([10, 11, 12, 13, 14, 10, 11])
    draft = propose(seq, SpecConfig(min_confidence=0.2), 5, (PromptLookupProposer(),))
    assert draft.tokens == [12, 13]  # 0.5, 0.25, then 0.125 < 0.2


def test_spec_config_validates_and_coerces():
    assert SpecConfig.coerce(None) == SpecConfig()
    assert SpecConfig.coerce("none").enabled is False
    assert SpecConfig.coerce(SpecConfig(max_draft=2)).max_draft == 2
    with pytest.raises(ValueError, match="method"):
        SpecConfig(method="medusa")
    with pytest.raises(ValueError, match="max_draft"):
        SpecConfig(max_draft=-1)
    with pytest.raises(ValueError, match="ngram"):
        SpecConfig(ngram_min=3, ngram_max=2)
    with pytest.raises(TypeError, match="spec"):
        SpecConfig.coerce(5)


# ------------------------------------------------------------------ verification

V = 8
ALLOWED = {0, 2, 3, 5, 6}      # the grammar mask of the synthetic model


def target_logits(prefix: tuple[int, ...]) -> torch.Tensor:
    """A fixed synthetic 'model': next-token logits depend on the prefix."""
    g = torch.Generator().manual_seed(1000 + hash(prefix) % 997)
    return torch.randn(1, V, generator=g) * 1.5


def draft_probs(prefix: tuple[int, ...]) -> torch.Tensor:
    """A synthetic drafter that disagrees with the target."""
    g = torch.Generator().manual_seed(7 + len(prefix))
    return torch.softmax(torch.randn(V, generator=g), dim=-1)


def plain_sample(seq, sampler: Sampler, n: int) -> tuple[int, ...]:
    out: list[int] = []
    for _ in range(n):
        res = sampler(target_logits(tuple(out)), [seq])
        out.append(res.token_ids[0])
        seq.token_ids.append(out[-1])
        seq.constraint.accept(out[-1])
    return tuple(out)


def spec_sample(seq, sampler: Sampler, n: int, drafter: str) -> tuple[int, ...]:
    """Draft n-1 tokens (a point mass or drafter samples), verify, bonus token."""
    out: list[int] = []
    g = torch.Generator().manual_seed(seq.generator.initial_seed() + 99)
    draft, probs = [], []
    for j in range(n - 1):
        q = draft_probs(tuple(draft))
        if drafter == "point":
            draft.append(j % V)
            probs.append(None)
        else:
            draft.append(int(torch.multinomial(q, 1, generator=g)))
            probs.append(q)
    for j in range(n):
        proposal = draft[j] if j < n - 1 else None
        verdict = sampler.verify(target_logits(tuple(out)), seq, proposal,
                                 probs[j] if j < n - 1 else None)
        out.append(verdict.token_id)
        seq.token_ids.append(verdict.token_id)
        seq.constraint.accept(verdict.token_id)
        if not verdict.accepted:
            break
    while len(out) < n:  # after a rejection, go on plainly
        res = sampler(target_logits(tuple(out)), [seq])
        out.append(res.token_ids[0])
        seq.token_ids.append(out[-1])
        seq.constraint.accept(out[-1])
    return tuple(out)


def chi_square(counts_a: dict, counts_b: dict) -> tuple[float, int]:
    """Two-sample chi-square statistic over the union of outcomes, and its dof."""
    keys = set(counts_a) | set(counts_b)
    na, nb = sum(counts_a.values()), sum(counts_b.values())
    stat = 0.0
    for k in keys:
        a, b = counts_a.get(k, 0), counts_b.get(k, 0)
        stat += (a * (nb / na) ** 0.5 - b * (na / nb) ** 0.5) ** 2 / (a + b)
    return stat, len(keys) - 1


@pytest.mark.parametrize("drafter", ["point", "sampled"])
def test_speculative_samples_follow_the_masked_target_distribution(drafter):
    sampler = Sampler(V, V)
    n, trials = 2, 4000
    plain, spec = {}, {}
    for seed in range(trials):
        a = make_seq([1], seed=seed, temperature=1.0)
        a.constraint = AllowOnly(ALLOWED)
        b = make_seq([1], seed=seed, temperature=1.0)
        b.constraint = AllowOnly(ALLOWED)
        x, y = plain_sample(a, sampler, n), spec_sample(b, sampler, n, drafter)
        assert set(x) <= ALLOWED and set(y) <= ALLOWED
        plain[x] = plain.get(x, 0) + 1
        spec[y] = spec.get(y, 0) + 1
    stat, dof = chi_square(plain, spec)
    assert dof == len(ALLOWED) ** n - 1
    # 24 degrees of freedom: the 0.999 quantile is 51.2 (seeds are fixed: no flakes)
    assert stat < 51.2, (stat, dof)


def test_first_position_matches_the_exact_masked_probabilities():
    sampler = Sampler(V, V)
    logits = target_logits(())
    masked = torch.full((V,), float("-inf"))
    masked[list(ALLOWED)] = logits[0, list(ALLOWED)]
    expected = _probs(masked, make_seq([1], temperature=1.0).params)
    counts = torch.zeros(V)
    trials = 6000
    for seed in range(trials):
        seq = make_seq([1], seed=seed, temperature=1.0)
        seq.constraint = AllowOnly(ALLOWED)
        counts[sampler.verify(logits.clone(), seq, 2).token_id] += 1
    observed = counts / trials
    assert observed[[1, 4, 7]].sum() == 0
    assert torch.allclose(observed, expected, atol=0.025), (observed, expected)


def test_greedy_verification_is_exact_match():
    sampler = Sampler(V, V)
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0, 0.0, 0.0, 0.0, 0.0]])
    seq = make_seq([1], temperature=0.0)
    assert sampler.verify(logits.clone(), seq, 2).accepted
    verdict = sampler.verify(logits.clone(), seq, 3)
    assert not verdict.accepted and verdict.token_id == 2
    seq.constraint = AllowOnly({0, 3})
    assert sampler.verify(logits.clone(), seq, 3).accepted
    seq.constraint = AllowOnly(set())
    assert "dead end" in sampler.verify(logits.clone(), seq, 3).error


def test_a_constrained_request_skips_lookup_candidates_its_grammar_rejects():
    # "7 8" occurs twice: most recently followed by 3 (not allowed), earlier by 5
    seq = make_seq([7, 8, 5, 6, 1, 7, 8, 3, 2, 7, 8])
    seq.constraint = AllowOnly({5, 6, 7, 8})
    seq.spec_lookup_proposed = seq.spec_lookup_accepted = 100
    cfg = SpecConfig(min_confidence=0.0)
    draft = propose(seq, cfg, 4, (PromptLookupProposer(2, 1),))
    assert draft.tokens == [5, 6]   # cut before 1, which the grammar rejects
    seq.constraint = None
    assert propose(seq, cfg, 2, (PromptLookupProposer(2, 1),)).tokens == [3, 2]


def test_step_cost_model_interpolates_and_averages():
    from formcast.engine.speculative.schedule import StepCostModel

    cost = StepCostModel(decay=0.5)
    assert cost.cost(3) is None
    cost.observe(1, 0.05)
    cost.observe(9, 0.09)
    assert cost.cost(1) == 0.05 and cost.cost(5) == pytest.approx(0.07)
    assert cost.cost(20) == 0.09   # flat beyond what was seen
    cost.observe(1, 0.07)
    assert cost.cost(1) == pytest.approx(0.06)


def test_verification_length_follows_confidence_and_step_cost():
    from formcast.engine.speculative.schedule import StepCostModel, choose_lengths

    flat = StepCostModel()
    flat.observe(1, 0.05)
    flat.observe(2, 0.07)
    flat.observe(8, 0.07)
    # a memory-bound step: once one extra position is paid for, more are free
    assert choose_lengths([[0.9, 0.8, 0.5, 0.2]], 1, flat) == [4]
    # a weak first position is not worth the jump from 1 to 2 tokens
    assert choose_lengths([[0.3, 0.1]], 1, flat) == [0]
    steep = StepCostModel()
    for n in range(1, 10):
        steep.observe(n, 0.05 + 0.045 * (n - 1))
    # each position costs nearly a full step: only near-certain ones pay
    assert choose_lengths([[1.0, 1.0, 0.6], [0.9]], 2, steep) == [2, 0]
    assert choose_lengths([[0.5], []], 2, StepCostModel()) == [1, 0]  # nothing measured yet


def test_draft_masks_are_filled_on_a_fork_position_by_position():
    from formcast.engine.speculative.proposers import fill_draft_masks

    class Narrowing(AllowOnly):
        """Allows tokens >= the last accepted one; forks."""

        def fill_bitmask(self, bitmask, row):
            self.allowed = set(range(self.accepted[-1] if self.accepted else 0, V))
            super().fill_bitmask(bitmask, row)

        def fork(self):
            twin = Narrowing(self.allowed)
            twin.accepted = list(self.accepted)
            return twin

    c = Narrowing(set())
    masks = fill_draft_masks(c, [2, 5], 1)
    assert c.accepted == []                       # the request's matcher is untouched
    bits = [[(int(masks[j, 0]) >> t) & 1 for t in range(V)] for j in range(3)]
    assert bits == [[1] * 8, [0, 0, 1, 1, 1, 1, 1, 1], [0] * 5 + [1, 1, 1]]
    assert fill_draft_masks(AllowOnly({1}), [1], 1) is None   # no fork: filled in place
    assert masks[:2].shape == Draft([2, 5], [1.0, 1.0], masks=masks).cut(1).masks.shape


def test_draft_masks_stop_at_a_draft_that_ends_the_grammar():
    """A draft whose last token is the grammar's stop token: the row after it is
    left empty instead of asking the terminated matcher (xgrammar refuses)."""
    pytest.importorskip("xgrammar")
    from formcast.engine.hub import resolve_model
    from formcast.engine.speculative.proposers import fill_draft_masks
    from formcast.engine.tokenizer_files import cached_gguf_tokenizer
    from formcast.grammars import Regex, compile

    tok = cached_gguf_tokenizer(resolve_model("smollm2").path)
    compiled = compile(Regex("yes|no"), tok, vocab_size=49152)
    eos = min(tok.eos_token_ids)
    draft = tok.encode("yes", add_special_tokens=False) + [eos]
    masks = fill_draft_masks(compiled.matcher(), draft, 1536)
    assert masks.shape == (len(draft) + 1, 1536)
    assert masks[-2].any() and not masks[-1].any()


# ------------------------------------------------------------------ draft memory

class ForcedText(AllowOnly):
    """Text ``prefix`` must come first (any tokenization of it), then any of
    ``after``; forced tokens are the greedy longest-token split of what is left."""

    def __init__(self, vocab: list[bytes], prefix: bytes, after: set[int]):
        super().__init__(set(range(len(vocab))))
        self.vocab, self.prefix, self.after = vocab, prefix, after

    def _left(self) -> bytes:
        done = b"".join(self.vocab[t] for t in self.accepted)
        return self.prefix[len(done):] if self.prefix.startswith(done) else b""

    def accept(self, token_id):
        left, text = self._left(), self.vocab[token_id]
        ok = (left.startswith(text) and text) if left else token_id in self.after
        if not ok:
            return False
        self.accepted.append(token_id)
        return True

    def valid_prefix(self, draft):
        n = 0
        for t in draft:
            if not self.accept(t):
                break
            n += 1
        self.rollback(n)
        return n

    def forced_tokens(self):
        left, out = self._left(), []
        while left:
            t = max((i for i, b in enumerate(self.vocab) if b and left.startswith(b)),
                    key=lambda i: len(self.vocab[i]))
            out.append(t)
            left = left[len(self.vocab[t]):]
        return out


VOCAB = [b'"', b"name", b'":"', b'":', b"Ann", b" Lee", b",", b'",', b"X"]


def test_jump_forward_learns_the_models_segmentation_of_forced_text():
    memory = DraftMemory(VOCAB)
    seq = make_seq([8, 8])
    seq.constraint = ForcedText(VOCAB, b'"name":"', after={4, 5, 6, 7})
    proposer = JumpForwardProposer(memory)
    first = proposer.propose(seq, seq.token_ids, 8)
    assert first.tokens == [0, 1, 2] and first.sources == ["forced"] * 3
    # the model wrote '":' where the grammar's split had '":"'
    memory.observe(seq, first, accepted=2, token=3)
    assert memory.segmentations == {2: 3}
    again = proposer.propose(seq, seq.token_ids, 8)
    assert again.tokens == [0, 1, 3, 0]  # its own split, then the rest of the text
    assert seq.constraint.accepted == []  # proposing left the matcher as it was


def test_lookup_closes_a_copied_value_where_the_model_did():
    memory = DraftMemory(VOCAB)
    seq = make_seq([4, 5, 6, 8, 8, 4])  # "Ann Lee, X X" then "Ann": lookup copies " Lee , X"
    seq.constraint = ForcedText(VOCAB, b"", after=set(range(len(VOCAB))))
    lookup = PromptLookupProposer(2, 1, memory=memory)
    plain = lookup.propose(seq, seq.token_ids, 3)
    assert plain.tokens == [5, 6, 8] and plain.sources == ["lookup"] * 3
    # the model closed the value ('",') where the text had ',' and the grammar then
    # forced what follows; from then on the closer replaces the delimiter
    seq.constraint.forced_tokens = lambda: [0]
    memory.observe(seq, plain, accepted=1, token=7)
    token, rate = memory.closer(6)
    assert token == 7 and rate == pytest.approx(2 / 3)
    closed = lookup.propose(seq, seq.token_ids, 3)
    assert closed.tokens == [5, 7] and closed.sources == ["lookup", "closer"]
    assert closed.confidence[1] == pytest.approx(closed.confidence[0] * 2 / 3)
    # copies that ran on past the delimiter lower its rate until it is not used
    for _ in range(2):
        memory.observe(seq, plain, accepted=3, token=None)
    assert memory.closer(6)[1] < 0.5
    assert lookup.propose(seq, seq.token_ids, 3).tokens == [5, 6, 8]


def closed_with(memory: DraftMemory, delimiter: int, closer: int, times: int) -> None:
    """``memory`` sees the model close a value with ``closer``, ``times`` times,
    where prompt lookup proposed ``delimiter`` and the grammar then forced text."""
    seq = make_seq([1])
    seq.constraint = ForcedText(VOCAB, b"", after=set(range(len(VOCAB))))
    seq.constraint.forced_tokens = lambda: [0]
    for _ in range(times):
        memory.observe(seq, Draft([delimiter], [0.5], ["lookup"]), accepted=0, token=closer)


def test_unconstrained_lookup_never_substitutes_a_closer():
    memory = DraftMemory(VOCAB)
    closed_with(memory, 6, 7, 5)
    assert memory.closer(6) is not None
    seq = make_seq([4, 5, 6, 8, 8, 4])
    assert PromptLookupProposer(2, 1, memory=memory).propose(seq, seq.token_ids, 3).tokens \
        == [5, 6, 8]


def test_a_rejected_closer_counts_against_it_when_the_model_copied_the_delimiter():
    memory = DraftMemory(VOCAB)
    closed_with(memory, 6, 7, 2)  # ',' closed twice with '",'
    seq = make_seq([4, 5, 6, 8, 8, 4])
    seq.constraint = ForcedText(VOCAB, b"", after=set(range(len(VOCAB))))
    closed = Draft([5, 7], [0.5, 0.3], ["lookup", "closer"])
    before = memory.closer(6)[1]
    memory.observe(seq, closed, accepted=1, token=6)  # the model wrote ',' itself
    assert memory.closer(6)[1] < before
    # a letter or digit the lookup proposed never becomes a delimiter with a closer
    seq.constraint.forced_tokens = lambda: [0]
    memory.observe(seq, Draft([4], [0.5], ["lookup"]), accepted=0, token=7)
    assert memory.closer(4) is None


# text lookup: a toy byte tokenizer whose words are single tokens after a space,
# the way the model's BPE spells " Pixel" but "P" + "ixel" at the start of a string
WORDS = [b"P", b"ixel", b" Pixel", b" Print", b" Studio", b".", b'"', b":", b"Print", b"x"]


def _encode(text: str) -> list[int]:
    data, out = text.encode(), []
    while data:
        t = max((i for i, w in enumerate(WORDS) if data.startswith(w)),
                key=lambda i: len(WORDS[i]))
        out.append(t)
        data = data[len(WORDS[t]):]
    return out


def test_text_lookup_continues_a_word_the_output_spells_differently():
    memory = DraftMemory(WORDS)
    # prompt " Pixel Print Studio." then output '"' 'P': no token n-gram matches 'P'
    seq = make_seq([2, 3, 4, 5, 6, 7, 6, 0])
    token_only = PromptLookupProposer(4, 2, memory=memory)
    assert token_only.propose(seq, seq.token_ids, 4).tokens == []
    lookup = PromptLookupProposer(4, 2, memory=memory, encode=_encode)
    draft = lookup.propose(seq, seq.token_ids, 4)
    # "P" matched in " Pixel" (which retokenizes as P + ixel, backing the output's
    # own P), not in " Print" (retokenized as one token "Print", which the output
    # would have written instead of "P")
    assert draft.tokens == [1, 3, 4, 5] and draft.sources == ["lookup"] * 4


def test_text_lookup_needs_a_letter_or_digit_and_an_encoder():
    memory = DraftMemory(WORDS)
    seq = make_seq([2, 5, 6, 7, 5])  # tail "." alone: punctuation matches anywhere
    assert PromptLookupProposer(4, 2, memory=memory, encode=_encode) \
        .text_continuations(seq.token_ids, 4) == []
    seq = make_seq([2, 3, 4, 5, 6, 7, 6, 0])
    assert PromptLookupProposer(4, 2, encode=_encode).text_continuations(seq.token_ids, 4) == []
