"""Small builders shared by the engine tests (no model needed)."""

from __future__ import annotations

import torch

from formcast.engine.constraint import BaseConstraint
from formcast.engine.sampling_params import SamplingParams
from formcast.engine.sequence import SamplingEpochs, Sequence


def make_seq(ids: list[int], *, rid: str = "r", max_tokens: int = 8, seed: int = 0,
             max_len: int = 10_000, epochs: SamplingEpochs | None = None,
             **params) -> Sequence:
    return Sequence(rid, ids, SamplingParams(max_tokens=max_tokens, **params), None,
                    torch.Generator().manual_seed(seed), max_len, epochs=epochs)


def packed(tokens: set[int], words: int) -> torch.Tensor:
    """A bitmask row ``words`` int32 wide allowing ``tokens``."""
    row = [0] * words
    for t in tokens:
        row[t // 32] |= 1 << (t % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in row], dtype=torch.int32)


class AllowOnly(BaseConstraint):
    """A hand-written LogitsConstraint: only the given token ids are ever allowed,
    and it terminates after ``length`` tokens when ``length`` is set."""

    def __init__(self, allowed: set[int], *, length: int | None = None):
        self.allowed = set(allowed)
        self.length = length
        self.accepted: list[int] = []

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = packed(self.allowed, bitmask.shape[1])

    def accept(self, token_id: int) -> bool:
        if token_id not in self.allowed or self.is_terminated():
            return False
        self.accepted.append(token_id)
        return True

    def rollback(self, num_tokens: int) -> None:
        del self.accepted[len(self.accepted) - num_tokens:]

    def is_terminated(self) -> bool:
        return self.length is not None and len(self.accepted) >= self.length

    def forced_tokens(self) -> list[int]:
        return []

    def valid_prefix(self, draft: list[int]) -> int:
        n = 0
        for t in draft:
            if t not in self.allowed:
                break
            n += 1
        return n


class Scripted(AllowOnly):
    """A hand-written LogitsConstraint over output positions: ``sets[p]`` the
    tokens allowed at position ``p`` (a narrow choice), None for every token (a
    wide one, as at every position past the script). Never terminates."""

    def __init__(self, sets: list[set[int] | None]):
        super().__init__(set())
        self.sets = sets

    def _allowed_at(self, at: int) -> set[int] | None:
        return self.sets[at] if at < len(self.sets) else None

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        allowed = self._allowed_at(len(self.accepted))
        bitmask[row] = -1 if allowed is None else packed(allowed, bitmask.shape[1])

    def accept(self, token_id: int) -> bool:
        allowed = self._allowed_at(len(self.accepted))
        if allowed is not None and token_id not in allowed:
            return False
        self.accepted.append(token_id)
        return True

    def valid_prefix(self, draft: list[int]) -> int:
        n = 0
        for t in draft:
            allowed = self._allowed_at(len(self.accepted) + n)
            if allowed is not None and t not in allowed:
                break
            n += 1
        return n

    def narrow_choice(self) -> bool:
        """(the engine's optional hook)"""
        return self._allowed_at(len(self.accepted)) is not None


def assert_logprobs_match_a_fresh_forward(engine, prompt_ids: list[int], out) -> None:
    """Each output token's logprob (asked with ``logprobs=0``) equals the one a full
    forward over prompt + output gives: the KV cache behind the run was clean."""
    import pytest

    assert len(out.logprobs) == len(out.token_ids)
    full = engine.forward_logits(list(prompt_ids) + list(out.token_ids))
    expected = torch.log_softmax(full[len(prompt_ids) - 1:-1], dim=-1)
    for k, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(float(expected[k, tok]), abs=1e-3), k


def count_word_risky(monkeypatch, word: int) -> None:
    """Premasking takes ``word`` as a span-closing token too, and every such
    token, wherever it stands, as one that closes a span (a tiny random model's
    quotes mostly stand where none belongs, its word inside a string). Masked
    rows' agreements on them count as any other (premasking alone is under
    test, not the rule of :meth:`Premasker.pick_closes_span`)."""
    from formcast.engine.pipeline.premask import Premasker

    closers = Premasker.closers_for
    monkeypatch.setattr(Premasker, "closers_for", lambda self, seqs: closers(self, seqs) | {word})
    monkeypatch.setattr(Premasker, "closes_span", lambda self, seq, token, appended: True)
    monkeypatch.setattr(Premasker, "pick_closes_span", lambda self, seqs, seq, token: False)


def count_calls(monkeypatch, owner, name: str) -> list:
    """Wrap ``owner.name`` (a function or method) so that each call appends to the
    list returned, then runs as before."""
    original = getattr(owner, name)
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def logprobs_agree_until_a_tie(outs_a, outs_b, tolerance: float) -> tuple[int, int]:
    """Two runs' outputs (asked with ``logprobs=0``), row by row: each token's
    log-probability agrees within ``tolerance`` up to the first token taken
    differently (a near-tie taken the other way: the rest differ by design).
    Returns the tokens compared and the tokens in all."""
    import pytest

    compared = total = 0
    for a, b in zip(outs_a, outs_b):
        total += len(a.logprobs)
        for x, y in zip(a.logprobs, b.logprobs):
            if x.token_id != y.token_id:
                break
            assert x.logprob == pytest.approx(y.logprob, abs=tolerance)
            compared += 1
    return compared, total
