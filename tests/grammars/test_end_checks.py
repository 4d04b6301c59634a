"""End-checked matchers: where a JSON document may end, and a matcher that asks
whether it is complete only there answers as one that asks after every token."""

from __future__ import annotations

import pytest
import torch

from formcast.grammars import EndCheckedMatcher, JsonSchema
from formcast.grammars.backends.xgrammar.text_masks import TextMasks
from formcast.grammars.json_ends import end_tokens, root_is_scalar

from .conftest import EOS, matcher_mask, segment_ids


@pytest.mark.parametrize(("token", "closer", "blank"), [
    (b"}", True, False), (b'"]', True, False), (b"a}b", True, False), (b"},", True, False),
    (b" ", False, True), (b"\n\t\r ", False, True), (b"", False, True),
    (b"{", False, False), (b" x", False, False), (b'"', False, False), (b"\xc3", False, False),
])
def test_end_tokens_sort_closers_and_whitespace(token, closer, blank):
    closers, blanks = end_tokens([b"x", token])
    assert (1 in closers, 1 in blanks) == (closer, blank)


@pytest.mark.parametrize(("parts", "scalar"), [
    ([], None), ([b"", b"  "], None), ([b"{"], False), ([b" ", b"\n["], False),
    ([b'"}'], True), ([b"12"], True), ([b"  tr", b"ue"], True), ([b"-"], True),
])
def test_root_is_scalar_reads_the_first_byte_that_is_not_whitespace(parts, scalar):
    assert root_is_scalar(parts) is scalar


# (schema, text walked token by token, a rollback and the text taken after it):
# each schema has an end check; roots of every kind, tokens holding a closer inside
# strings, and a rollback that changes the root's kind
_LOOKAHEAD = {"type": "string", "pattern": "^(?!z)"}
_UNIQUE = {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True}
_CASES = [
    (_UNIQUE, "[1,2]", 2, "1]"),
    (_UNIQUE, "[1,1]", 2, "2]"),
    (_LOOKAHEAD, '"a}b]c"', 3, 'zz"'),
    (_LOOKAHEAD, '"}]"', 1, '"'),
    ({"type": "integer", "multipleOf": 2048}, "4096", 2, "97"),
    ({"type": "object", "properties": {"k": _LOOKAHEAD}, "required": ["k"]},
     '{"k":"}"}', 2, '"}'),
    ({"type": "object", "properties": {"k": _LOOKAHEAD}, "required": ["k"]},
     '{"k":"z"}', 3, 'y"}'),
    ({"anyOf": [_UNIQUE, _LOOKAHEAD]}, "[2,2]", 5, '"ab"'),
    ({"anyOf": [_UNIQUE, _LOOKAHEAD]}, '"x]"', 4, "[1]"),
]


def _same(a, b, compiled) -> None:
    assert a.is_completed() == b.is_completed()
    assert a.last_violation == b.last_violation
    assert a.rollback_hint() == b.rollback_hint()
    assert torch.equal(matcher_mask(a, compiled), matcher_mask(b, compiled))


@pytest.mark.parametrize(("schema", "text", "back", "then"), _CASES)
def test_an_end_checked_matcher_answers_as_one_that_checks_after_every_token(
        schema, text, back, then, compiler, tiny_vocab):
    compiled = compiler.compile(JsonSchema(schema), tiny_vocab)
    assert compiled.end_check is not None
    fast = compiled.matcher()
    # the same check asked after every token (no token classes given)
    slow = EndCheckedMatcher(compiled.grammar.matcher(), compiled.end_check,
                             tiny_vocab.token_bytes, tiny_vocab.eos_token_ids)
    _same(fast, slow, compiled)
    for t in segment_ids(tiny_vocab, text):
        assert fast.accept(t) == slow.accept(t) is True
        _same(fast, slow, compiled)
    fork = fast.fork()
    for m in (fast, slow, fork):
        m.rollback(back)
    _same(fast, slow, compiled)
    _same(fork, slow, compiled)
    for t in segment_ids(tiny_vocab, then):
        assert fast.accept(t) == slow.accept(t) == fork.accept(t)
        _same(fast, slow, compiled)
        _same(fork, slow, compiled)
    ended = slow.accept(EOS)
    assert fast.accept(EOS) == ended and fork.accept(EOS) == ended


@pytest.mark.parametrize(("schema", "text", "ends"), [
    (_UNIQUE, "[1,2]", True), (_UNIQUE, "[2,2]", False), (_LOOKAHEAD, '"}"', True),
    (_LOOKAHEAD, '"z}"', False), ({"type": "integer", "multipleOf": 2048}, "2048", True),
])
def test_an_end_checked_matcher_ends_a_document_only_when_it_passes(schema, text, ends,
                                                                  compiler, tiny_vocab):
    m = compiler.compile(JsonSchema(schema), tiny_vocab).matcher()
    assert all(m.accept(t) for t in segment_ids(tiny_vocab, text))
    assert m.is_completed() == ends and m.accept(EOS) == ends


def test_text_masks_grow_and_keep_every_row():
    masks = TextMasks(words=3, capacity=10)
    early = None
    for k in range(12):
        masks.add(b"t%d" % k, torch.full((3,), k, dtype=torch.int32).numpy())
        if k == 1:
            early = masks.rows     # (held by a reader while the rows grow)
    assert len(masks.slots) == 10 and masks.row(b"t10", 3) is None   # full at capacity
    for k in range(10):
        at = masks.row(b"t%d" % k, 3)
        assert at is not None and masks.rows[at].tolist() == [k] * 3
    assert [row.tolist() for row in early[:2]] == [[0] * 3, [1] * 3]
    masks.add(b"t0", torch.full((3,), 99, dtype=torch.int32).numpy())   # a known text stays
    assert masks.rows[masks.row(b"t0", 3)].tolist() == [0] * 3
    assert masks.row(b"t1", 4) is None                                  # another width
