"""xgrammar logs on file descriptor 2 whatever a matcher is offered after its end:
formcast's matchers never let it, and answer those calls themselves."""

from __future__ import annotations

import pytest

from formcast.grammars import JsonSchema, Regex

from .conftest import EOS, PAD_SPECIAL


def _ids(vocab, text: str) -> list[int]:
    ids = vocab.segment(text.encode("utf-8"))
    assert ids is not None
    return ids


@pytest.mark.parametrize(("constraint", "text"), [
    (Regex("ab"), "ab"),
    (JsonSchema({"type": "array", "items": {"enum": [1, 2]}}), "[1]"),
    # an end-checked schema: the end check wraps the xgrammar matcher
    (JsonSchema({"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True}), "[1,2]"),
])
def test_an_ended_matcher_refuses_everything_without_a_word_on_stderr(
        constraint, text, compiler, tiny_vocab, capfd):
    compiled = compiler.compile(constraint, tiny_vocab, backend="xgrammar")
    capfd.readouterr()
    m = compiled.matcher()
    assert all(m.accept(t) for t in _ids(tiny_vocab, text))
    assert m.accept(EOS) and m.is_terminated()
    later = _ids(tiny_vocab, "a1]")
    assert [m.accept(t) for t in (EOS, PAD_SPECIAL, *later)] == [False] * (2 + len(later))
    assert not m.accept_text("a")
    bitmask = compiled.allocate_bitmask(1)
    m.fill_bitmask(bitmask, 0)
    assert not bitmask.any()                 # nothing is allowed after the end
    assert m.forced_tokens() == []
    copy = m.fork()
    assert copy.is_terminated() and not copy.accept(later[0]) and not copy.accept(EOS)
    ops = type(m).accept_tokens if hasattr(type(m), "accept_tokens") else None
    if ops is not None:
        assert ops([m, copy], [EOS, EOS]) == [0, 0]
    m.rollback(1)                            # the stop token taken back: it may end again
    assert not m.is_terminated() and m.accept(EOS) and m.is_terminated()
    assert capfd.readouterr().err == ""
