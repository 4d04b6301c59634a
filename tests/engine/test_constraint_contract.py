"""The typed engine/grammar contract: :class:`BaseConstraint`'s defaults, the
per-class resolution of a class's optional operations (:func:`ops_for`), and
the engine driving a bare ``LogitsConstraint`` and a subclass's own hooks."""

from __future__ import annotations

import pytest
import torch

from formcast.engine import Engine, EngineConfig, SamplingParams
from formcast.engine.constraint import (BaseConstraint, LogitsConstraint, ops_for,
                                        take_forced_tokens)

from .helpers import AllowOnly, packed

V = 64
BATCH = ("fill_bitmasks", "fill_distinct_bitmasks", "accept_tokens", "batch_acceptor",
         "prepare", "tidy")


class Bare:
    """A user-written LogitsConstraint: the protocol's six methods, no base class.
    Allows ``allowed``; ends after ``length`` tokens."""

    def __init__(self, allowed: set[int], length: int) -> None:
        self.allowed, self.length = set(allowed), length
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
        return len(self.accepted) >= self.length

    def forced_tokens(self) -> list[int]:
        return [min(self.allowed)] if len(self.allowed) == 1 else []

    def valid_prefix(self, draft: list[int]) -> int:
        n = 0
        while n < len(draft) and draft[n] in self.allowed:
            n += 1
        return n


class OwnAccept(AllowOnly):
    calls: list[int] = []

    @classmethod
    def accept_tokens(cls, constraints, tokens):
        cls.calls.append(len(tokens))
        return super().accept_tokens(constraints, tokens)


class OwnPrepare(AllowOnly):
    prepared: list[int] = []

    @staticmethod
    def prepare(constraints):
        OwnPrepare.prepared.append(len(constraints))


class Narrow(AllowOnly):
    def forces_text(self) -> bool:
        return True


class Spans(AllowOnly):
    """Its language's spans close with token 5 (6 may, but never does here)."""

    @classmethod
    def span_closing_tokens(cls, token_bytes):
        return frozenset({5, 6})

    def closes_span(self, token_ids, start, end, token):
        return token == 5


class BrokenSpans(AllowOnly):
    @classmethod
    def span_closing_tokens(cls, token_bytes):
        raise RuntimeError("broken")

    def closes_span(self, token_ids, start, end, token):
        raise RuntimeError("broken")


@pytest.mark.parametrize("kinds, closers", [
    ([Bare], set()), ([AllowOnly], set()), ([Spans], {5, 6}), ([BrokenSpans], set()),
    ([Spans, Bare, BrokenSpans, AllowOnly], {5, 6}),
])
def test_premasking_asks_each_row_s_constraint_for_its_spans(kinds, closers):
    """Premasking watches the tokens the rows' constraint classes say may close
    a span (none by default, none from a class whose answer fails) and asks each
    row's own constraint whether its token does (never by default, nor where
    the answer fails)."""
    from formcast.engine.pipeline import PipelineStats
    from formcast.engine.pipeline.premask import Premasker
    from formcast.engine.tuning import EngineTuning

    from .helpers import make_seq

    class Spelling:  # (the tokenizer as premasking reads it)
        def token_bytes(self) -> list[bytes]:
            return [b"x"] * V

    premasker = Premasker(Spelling(), EngineTuning(), PipelineStats())
    seqs = [make_seq([1, 2], rid=str(k)) for k in range(len(kinds))]
    for seq, kind in zip(seqs, kinds):
        seq.constraint = kind({3, 5}, length=2)
    assert premasker.closers_for(seqs) == closers
    assert [premasker.closes_span(seq, 5, False) for seq in seqs] == \
        [kind is Spans for kind in kinds]
    assert not any(premasker.closes_span(seq, 6, False) for seq in seqs)


@pytest.mark.parametrize("kind, own", [
    (Bare, set()),
    (AllowOnly, set()),                 # derives, overrides nothing
    (OwnAccept, {"accept_tokens"}),
    (OwnPrepare, {"prepare"}),
])
def test_a_class_s_own_batch_operations_are_found_once_per_class(kind, own):
    ops = ops_for(kind)
    assert {name for name in BATCH if getattr(ops, name) is not None} == own
    assert ops_for(kind) is ops


@pytest.mark.parametrize("kind, forces, narrow", [
    (Bare, False, False), (AllowOnly, False, False), (Narrow, True, True)])
def test_per_instance_hooks_default_as_if_absent(kind, forces, narrow):
    c = kind({3}, length=2)
    ops = ops_for(kind)
    assert isinstance(c, LogitsConstraint)
    assert (ops.forces_text(c), ops.narrow_choice(c)) == (forces, narrow)
    assert ops.rollback_hint(c) == 0 and ops.last_violation(c) is None
    assert ops.fork(c) is None


@pytest.mark.parametrize("allowed, tokens, verdicts", [
    ({1, 2}, [1, 2], [1, 1]),
    ({1, 2}, [1, 5], [1, 0]),
    ({1}, [1, 1], [2, 2]),      # length 1: taken and terminated
])
def test_default_accept_tokens_and_batch_acceptor_give_per_row_verdicts(allowed, tokens,
                                                                        verdicts):
    length = 1 if len(allowed) == 1 else 5
    assert AllowOnly.accept_tokens([AllowOnly(allowed, length=length) for _ in tokens],
                                   tokens) == verdicts
    prepared = AllowOnly.batch_acceptor([AllowOnly(allowed, length=length) for _ in tokens])
    assert prepared(tokens) == verdicts and prepared.subset([0]) is None
    assert prepared.launch(torch.zeros(2, len(tokens), dtype=torch.long), [0], None) is None


def test_default_batch_fills_write_what_row_by_row_fills_write():
    constraints = [AllowOnly({1, 40}), AllowOnly({7}), AllowOnly(set(range(V)))]
    want = torch.zeros(3, V // 32, dtype=torch.int32)
    for i, c in enumerate(constraints):
        c.fill_bitmask(want, i)
    got = torch.full((3, V // 32), -1, dtype=torch.int32)  # (written whole: not cleared)
    AllowOnly.fill_bitmasks(constraints, got, [0, 1, 2])
    assert torch.equal(got, want)
    got = torch.full((3, V // 32), -1, dtype=torch.int32)
    assert AllowOnly.fill_distinct_bitmasks(constraints, got) is None
    assert torch.equal(got, want)


@pytest.mark.parametrize("make, limit, taken", [
    (lambda: Bare({9}, length=3), 5, [9]),
    (lambda: AllowOnly({9}), 5, []),        # forces nothing
    (lambda: Bare({9}, length=3), 0, []),
])
def test_jump_forward_takes_a_bare_constraint_s_forced_tokens(make, limit, taken):
    c = make()
    assert take_forced_tokens(c, limit) == taken and c.accepted == taken


def _chat(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=True)


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_bare_constraint_drives_generate(smollm2_engine, pipelined):
    """A constraint with the protocol alone restricts every token and ends the
    request, on the synchronous and the pipelined step alike."""
    engine = Engine(smollm2_engine.model, smollm2_engine.tokenizer, device=smollm2_engine.device,
                    config=EngineConfig(async_scheduling=pipelined, spec="none"))
    tok = engine.tokenizer
    digits = {tok.encode(str(d))[0] for d in range(10)}
    constraints = [Bare(digits, length=5) for _ in range(2)]
    outs = engine.generate([_chat(engine, "Say hello."), _chat(engine, "Name a fruit.")],
                           SamplingParams(max_tokens=12, temperature=0.0),
                           constraints=constraints)
    for out, c in zip(outs, constraints):
        assert out.error is None and out.finish_reason == "stop"
        assert len(out.token_ids) == 5 and set(out.token_ids) <= digits
        assert c.accepted == list(out.token_ids)


def test_a_subclass_s_own_batch_hooks_are_called(smollm2_engine):
    """``prepare`` before the first step, ``accept_tokens`` for the pipelined
    step's unmasked greedy picks; the tokens are those of the base class."""
    engine = Engine(smollm2_engine.model, smollm2_engine.tokenizer, device=smollm2_engine.device,
                    config=EngineConfig(async_scheduling=True, spec="none"))
    every = set(range(engine.tokenizer.vocab_size))
    prompts = [_chat(engine, "Say hi."), _chat(engine, "Name a river.")]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = engine.generate(prompts, greedy, constraints=[AllowOnly(every) for _ in prompts])
    OwnAccept.calls, OwnPrepare.prepared = [], []
    got = engine.generate(prompts, greedy, constraints=[OwnAccept(every) for _ in prompts])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert OwnAccept.calls and sum(OwnAccept.calls) <= 2 * 8
    engine.generate(prompts, greedy, constraints=[OwnPrepare(every) for _ in prompts])
    assert OwnPrepare.prepared == [2]
