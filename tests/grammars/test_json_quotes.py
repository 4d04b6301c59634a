"""JSON strings as the spans the engine's premasking watches: which tokens may
close one, and whether a token does, answered by a matcher through the
engine/grammar contract (``span_closing_tokens``, ``closes_span``)."""

from __future__ import annotations

import pytest

from formcast.grammars import JsonSchema, Regex
from formcast.grammars.json_quotes import QuoteParity, quote_counts, quote_tokens
from formcast.grammars.matcher import Matcher

SCHEMA = {"type": "object", "required": ["name", "age"], "additionalProperties": False,
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
# {"name":"ab","age":12}, token by token, and whether each quote-holding token
# closes a string (None: it holds no quote)
DOCUMENT = [('{"', False), ("name", None), ('":"', False), ("ab", None), ('",', True),
            ('"', False), ("age", None), ('":', True), ("12", None), ("}", None)]


@pytest.mark.parametrize("token, count", [
    (b'"', 1), (b'":"', 2), (b'\\"', 0), (b'a\\"b"', 1), (b"name", 0), (b"", 0)])
def test_quote_counts_leave_out_escaped_quotes(token, count):
    assert quote_counts([token]) == [count]
    assert quote_tokens([token]) == (frozenset({0}) if count else frozenset())


def ids_of(vocab, texts):
    return [vocab.token_bytes.index(t.encode()) for t in texts]


def test_the_span_closing_tokens_are_those_holding_a_quote(tiny_vocab):
    closers = Matcher.span_closing_tokens(tiny_vocab.token_bytes)
    assert set(ids_of(tiny_vocab, ['"', '{"', '":', '",', '"}'])) <= closers
    assert closers.isdisjoint(ids_of(tiny_vocab, ["name", "12", "{", "}", ",", "\\"]))


@pytest.mark.parametrize("constraint, closes", [(JsonSchema(SCHEMA), True),
                                                (Regex(r'\{"name":"ab","age":12\}'), False)])
def test_a_matcher_says_which_quotes_close_a_string(compiler, tiny_vocab, constraint, closes):
    """A JSON Schema's matcher answers by the parity of the output's quotes
    (the prompt before ``start`` not counted), whether asked before the token
    is appended or after; another language's matcher closes no span."""
    matcher = compiler.compile(constraint, tiny_vocab).matcher()
    prompt = ids_of(tiny_vocab, ['"'])  # (an odd prompt: ignored)
    ids = list(prompt)
    got, want = [], []
    for text, expected in DOCUMENT:
        token = ids_of(tiny_vocab, [text])[0]
        assert matcher.accept(token)
        if expected is not None:
            want += [expected and closes] * 2
            got.append(matcher.closes_span(ids, len(prompt), len(ids), token))
        ids.append(token)
        if expected is not None:
            got.append(matcher.closes_span(ids, len(prompt), len(ids) - 1, token))
    assert got == want


def test_a_rollback_counts_the_replaced_tokens_again(compiler, tiny_vocab):
    """Tokens replaced at the same length (a rollback, then other tokens) are
    counted afresh: the answer follows the new output, not the one counted."""
    matcher = compiler.compile(JsonSchema(SCHEMA), tiny_vocab).matcher()
    opening, value, key_end, quote = ids_of(tiny_vocab, ['{"', '":"', '":', '"'])
    ids = [opening, ids_of(tiny_vocab, ["name"])[0], value]
    for token in ids:
        assert matcher.accept(token)
    assert matcher.closes_span(ids, 0, 3, quote)  # ('{"name":"' then '"': an empty value)
    matcher.rollback(1)
    assert matcher.accept(key_end)
    ids[2] = key_end  # ('{"name":' then '"': the value opens)
    assert not matcher.closes_span(ids, 0, 3, quote)


def test_quote_parity_counts_on_and_starts_again_when_taken_back():
    counts = [0, 1, 2]  # (token 1: one quote, token 2: two)
    parity = QuoteParity(counts)
    ids = [1, 0, 2, 0]
    assert parity.closes(ids, 0, 1, 1)          # 1 + 1: even
    assert not parity.closes(ids, 0, 4, 2)      # 1 + 2 + 2: odd
    assert parity.closes(ids, 0, 0, 0)          # (taken back to nothing: even)
    assert not parity.closes(ids, 0, 2, 0)      # counted afresh: 1
    prompted = QuoteParity(counts)              # (the token before start not counted)
    assert parity.closes(ids, 0, 4, 1) and not prompted.closes(ids, 1, 4, 1)
