"""Every valid string is accepted to termination; every invalid one is rejected.

Run for both backends, with a tiny synthetic vocabulary and with SmolLM2's. Each
accepted token must also be allowed by the mask, and each rejected one disallowed, so
the mask and ``accept`` can never disagree.
"""

from __future__ import annotations

import pytest

from formcast.grammars import Vocabulary

from .cases import BOTH, CASES, Case
from .conftest import bit_set

PARAMS = [pytest.param(case, backend, id=f"{case.id}-{backend}")
          for case in CASES for backend in BOTH if backend in case.backends]


def _tokens(text: str, vocab: Vocabulary, tokenizer) -> list[int]:
    if tokenizer is None:
        ids = vocab.segment(text.encode("utf-8"))
        assert ids is not None
        return ids
    return tokenizer.encode(text, add_special_tokens=False)


def _run(case: Case, backend: str, compiler, vocab, tokenizer) -> None:
    compiled = compiler.compile(case.constraint, tokenizer or vocab, backend=backend)
    eos = min(compiled.vocab.eos_token_ids)
    bitmask = compiled.allocate_bitmask(1)
    for text in case.valid:
        m = compiled.matcher()
        for token in _tokens(text, compiled.vocab, tokenizer):
            m.fill_bitmask(bitmask, 0)
            assert bit_set(bitmask, 0, token), f"{text!r}: token {token} masked out"
            assert m.accept(token), f"{text!r}: token {token} rejected"
        m.fill_bitmask(bitmask, 0)
        assert m.is_completed() and bit_set(bitmask, 0, eos), f"{text!r}: eos not allowed"
        assert m.accept(eos) and m.is_terminated(), f"{text!r}: not terminated"
        assert case.oracle(text), f"the table's valid string {text!r} fails the oracle"
    for text in case.invalid:
        m = compiled.matcher()
        rejected = False
        for token in _tokens(text, compiled.vocab, tokenizer):
            m.fill_bitmask(bitmask, 0)
            allowed = bit_set(bitmask, 0, token)
            accepted = m.accept(token)
            assert allowed == accepted, f"{text!r}: mask says {allowed}, accept says {accepted}"
            if not accepted:
                rejected = True
                break
        if not rejected:
            m.fill_bitmask(bitmask, 0)
            assert not bit_set(bitmask, 0, eos), f"{text!r}: invalid string may terminate"
            assert not m.accept(eos) and not m.is_terminated()
        assert not case.oracle(text), f"the table's invalid string {text!r} passes the oracle"


@pytest.mark.parametrize("case,backend", PARAMS)
def test_conformance_tiny_vocab(case, backend, compiler, tiny_vocab):
    _run(case, backend, compiler, tiny_vocab, None)


@pytest.mark.parametrize("case,backend", PARAMS)
def test_conformance_smollm2(case, backend, compiler, smollm2_tokenizer):
    _run(case, backend, compiler, None, smollm2_tokenizer)
