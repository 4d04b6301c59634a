"""``stop_loops``: a JSON string that repeats one unit again and again must close next
(the server's guard against answers that run on to ``max_tokens``)."""

from __future__ import annotations

import pytest
import torch

from formcast.grammars import JsonSchema, grounding_plan
from formcast.grammars.grounded_matcher import looping

from .conftest import allowed_ids


@pytest.mark.parametrize("content,expected", [
    (b"ab" * 16, True),                      # 32 bytes of one unit
    (b"ab" * 15, False),                     # too short to call it a loop
    (b"x" * 32, True),
    (b"x" * 31, False),
    (b"LANDMARK_" * 4, True),
    (b"Sales " * 3, False),
    (b"1000 2000 " * 4, True),
    (b"Difficulty: Easy, Difficulty: Medium, Difficulty: Hard, " * 3, True),
    (b"Difficulty: Easy, Difficulty: Medium, Difficulty: Hard, " * 2, False),  # 2 repeats
    (b"a sentence that says something new in every one of its words", False),
    (b"ab" * 16 + b"c", False),              # the loop was left
    (b"", False),
])
def test_looping(content, expected):
    assert looping(content) is expected


def _ids(vocab, text: str) -> list[int]:
    by_bytes = {b: i for i, b in enumerate(vocab.token_bytes) if len(b) == 1}
    return [by_bytes[bytes([c])] for c in text.encode()]


def _matcher(compiler, vocab, schema, stop_loops=True):
    compiled = compiler.compile(JsonSchema(schema), vocab)
    return compiled.grounded_matcher("", grounding_plan(schema, "off"), stop_loops=stop_loops)


def _allowed_bytes(matcher, vocab) -> set[bytes]:
    mask = torch.zeros(1, vocab.bitmask_words, dtype=torch.int32)
    matcher.fill_bitmask(mask, 0)
    return {vocab.token_bytes[t] for t in allowed_ids(mask, 0, len(vocab.token_bytes))}


@pytest.mark.parametrize("stop_loops,written,closes_only", [
    (True, "ab" * 16, True),
    (True, "ab" * 15, False),
    (True, "a sentence, not a loop", False),
    (False, "ab" * 16, False),
])
def test_a_looping_string_may_only_close(compiler, tiny_vocab, stop_loops, written,
                                         closes_only):
    m = _matcher(compiler, tiny_vocab, {"type": "string"}, stop_loops)
    for t in _ids(tiny_vocab, '"' + written):
        assert m.accept(t)
    allowed = _allowed_bytes(m, tiny_vocab)
    assert all(b.startswith(b'"') for b in allowed) is closes_only
    assert b'"' in allowed
    assert m.accept(_ids(tiny_vocab, "a")[0]) is not closes_only


def test_a_loop_inside_an_object_closes_and_the_document_goes_on(compiler, tiny_vocab):
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["a", "n"]}
    m = _matcher(compiler, tiny_vocab, schema)
    for t in _ids(tiny_vocab, '{"a":"' + "xy" * 16):
        assert m.accept(t)
    assert all(b.startswith(b"\"") for b in _allowed_bytes(m, tiny_vocab))
    for t in _ids(tiny_vocab, '","n":1}'):
        assert m.accept(t)
    assert m.is_terminated() or m.is_completed()
    assert m.violations == ()


def test_a_loop_the_schema_cannot_close_falls_back_and_is_recorded(compiler, tiny_vocab):
    m = _matcher(compiler, tiny_vocab, {"type": "string", "minLength": 40})
    for t in _ids(tiny_vocab, '"' + "ab" * 16):
        assert m.accept(t)
    assert b"a" in _allowed_bytes(m, tiny_vocab)        # '"' is not allowed yet
    assert m.accept(_ids(tiny_vocab, "a")[0])
    assert [v.kind for v in m.violations] == ["loop"]
    m.rollback(1)
    assert m.violations == ()


def test_fork_keeps_stop_loops(compiler, tiny_vocab):
    m = _matcher(compiler, tiny_vocab, {"type": "string"})
    for t in _ids(tiny_vocab, '"' + "ab" * 16):
        assert m.accept(t)
    other = m.fork()
    assert not other.accept(_ids(tiny_vocab, "a")[0])
    assert other.accept(_ids(tiny_vocab, '"')[0])


@pytest.mark.parametrize("stop_loops,written,ends_only", [
    (True, "[1." + "1" * 32, True),
    (True, "[1." + "1" * 20, False),
    (False, "[1." + "1" * 32, False),
])
def test_a_looping_number_may_only_end(compiler, tiny_vocab, stop_loops, written, ends_only):
    m = _matcher(compiler, tiny_vocab, {"type": "array", "items": {"type": "number"}},
                 stop_loops)
    for t in _ids(tiny_vocab, written):
        assert m.accept(t)
    allowed = _allowed_bytes(m, tiny_vocab)
    assert all(b[0] not in b"0123456789.eE+-" for b in allowed if b) is ends_only
    assert b"]" in allowed
    assert m.accept(_ids(tiny_vocab, "1")[0]) is not ends_only


def test_a_loop_in_a_repeated_item_agrees_with_distinct_items(compiler, tiny_vocab):
    schema = {"type": "array", "items": {"type": "string"}}
    compiled = compiler.compile(JsonSchema(schema), tiny_vocab)
    m = compiled.grounded_matcher("", grounding_plan(schema, "off"), distinct_items=True,
                                  stop_loops=True)
    for t in _ids(tiny_vocab, '["' + "ab" * 16 + '","' + "ab" * 16):
        assert m.accept(t)
    mask = torch.zeros(1, tiny_vocab.bitmask_words, dtype=torch.int32)
    m.fill_bitmask(mask, 0)
    allowed = allowed_ids(mask, 0, len(tiny_vocab.token_bytes))
    assert {tiny_vocab.token_bytes[t] for t in allowed} >= {b'"', b'"]'}
    assert b'",' not in {tiny_vocab.token_bytes[t] for t in allowed}  # (the item repeats)
    assert all(m.fork().accept(int(t)) for t in allowed)  # (every token the mask allows)
