"""Grounded values: the plan, the text's numbers, and masks that admit exactly the
substrings of the text (against a brute-force oracle), escapes, numbers, distinct
array items, fallback, rollback/fork/valid_prefix, and the real engine."""

from __future__ import annotations

import json
import random
import re
from typing import Annotated

import numpy as np
import pytest
import torch
from pydantic import BaseModel

from formcast.grammars import (ConstraintError, Grounded, GroundingPlan, JsonSchema, NotGrounded,
                               ground, grounding_plan)
from formcast.grammars import compile as compile_constraint
from formcast.grammars.grounding_source import (START, STOP, capitalised, escape_text,
                                                source_tables)
from formcast.grammars.grounding_text import text_numbers

from .conftest import EOS, allowed_ids

STRINGS = {"type": "array", "items": {"type": "string"}, "maxItems": 4}
RECORD = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}}
NUMBERS = {"type": "array", "items": {"type": "number"}, "maxItems": 3}


def _ids(vocab, text: str) -> list[int]:
    ids = vocab.segment(text.encode("utf-8"))
    assert ids is not None
    return ids


def _mask(matcher, width: int) -> torch.Tensor:
    bitmask = torch.zeros(1, width, dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    return bitmask


def _allowed(matcher, vocab) -> set[int]:
    return set(allowed_ids(_mask(matcher, vocab.bitmask_words), 0, vocab.vocab_size).tolist())


# -- the plan ---------------------------------------------------------------------

class Address(BaseModel):
    city: str
    zip_code: Annotated[str, NotGrounded]


class Person(BaseModel):
    name: str
    age: Annotated[int, Grounded]
    height: float
    email: str | None = None
    kind: str = "x"
    home: Address
    friends: list[str]
    summary: Annotated[str, NotGrounded]


PERSON_SCHEMA = Person.model_json_schema()
PERSON_SCHEMA["properties"]["kind"] = {"type": "string", "enum": ["a", "b"]}


@pytest.mark.parametrize("mode, strings, numbers", [
    ("off", set(), set()),
    ("auto", {("name",), ("email",), ("home", "city"), ("friends", "*")}, {("age",)}),
    ("strict", {("name",), ("email",), ("home", "city"), ("friends", "*")},
     {("age",), ("height",)}),
])
def test_plan_walks_refs_unions_and_markers(mode, strings, numbers):
    plan = grounding_plan(PERSON_SCHEMA, mode)
    want = GroundingPlan(frozenset(strings), frozenset(numbers), frozenset(numbers & {("age",)}))
    assert plan == want                   # (the integer age takes whole numbers only)
    assert bool(plan) == (mode != "off")
    assert hash(plan) == hash(want)


@pytest.mark.parametrize("schema, strings", [
    ({"type": "string"}, {()}),
    ({"type": "string", "format": "date"}, set()),
    ({"type": "string", "pattern": "^a"}, set()),
    ({"type": "string", "x-grounded": False}, set()),
    ({"type": "string", "format": "date", "x-grounded": True}, {()}),
    ({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]}, {("*",)}),
    ({"type": "array", "x-grounded": False, "items": {"type": "string"}}, set()),
    ({"$defs": {"N": {"type": "object", "properties": {"n": {"$ref": "#/$defs/N"},
                                                       "s": {"type": "string"}}}},
      "$ref": "#/$defs/N"}, {("s",), ("n", "s"), ("n", "n", "s")}),
])
def test_plan_table(schema, strings):
    assert grounding_plan(schema).strings == frozenset(strings)


def test_markers_write_the_schema_keyword():
    props = PERSON_SCHEMA["properties"]
    assert props["age"]["x-grounded"] is True and props["summary"]["x-grounded"] is False


@pytest.mark.parametrize("mode", ["on", "", None])
def test_bad_mode_is_a_constraint_error(mode):
    with pytest.raises(ConstraintError, match="grounding mode"):
        grounding_plan({"type": "string"}, mode)


# -- the text -------------------------------------------------------------------------

@pytest.mark.parametrize("text, present, absent", [
    ("costs $89.99 today", {b"89.99"}, {b"89", b"99", b"89.9", b"1.99", b"8999", b"-89.99"}),
    ("a 35-year-old pilot", {b"35"}, {b"-35", b"3"}),
    ("total 1,299.00 EUR", {b"1299.00", b"1299.0", b"1299"}, {b"1,299", b"12", b"1", b"299"}),
    ("price 4,95 EUR", {b"4.95", b"4", b"95"}, {b"495"}),
    ("Galaxy S24 for 799", {b"799"}, {b"24"}),
    ("on 2025-03-08", {b"2025", b"3", b"8"}, {b"03", b"-3", b"-8"}),  # (a "day" field takes 8)
    ("it was -5 C, then - 4", {b"-5", b"5", b"4"}, {b"-4"}),
    ("version 2.50", {b"2.50", b"2.5"}, {b"2", b"50", b"2.500"}),
    ("no numbers here", set(), {b"0"}),
])
def test_text_numbers(text, present, absent):
    found = text_numbers(text)
    assert present <= found and not (absent & found)


@pytest.mark.parametrize("text, body, boundaries", [
    ('a"b', b'a\\"b', [0, 1, 3, 4]),
    ("é\n", "é\\n".encode(), [0, 2, 4]),
    ("\x01\\", b"\\u0001\\\\", [0, 6, 8]),
])
def test_escaped_text_and_boundaries(text, body, boundaries):
    escaped, marks = escape_text(text)
    assert escaped == body
    assert [k for k, m in enumerate(marks) if m] == boundaries


@pytest.mark.parametrize("text, starts, stops", [
    # never inside a word; a value neither starts at a space nor ends after one
    ("a plumber, Dublin", [0, 2, 9, 11, 17], [0, 1, 9, 10, 17]),
    ("O'Connor 52", [0, 1, 2, 9, 11], [0, 1, 2, 8, 11]),
    ("東京 tower", [0, 3, 7, 12], [0, 3, 6, 12]),                 # ideographs: a word each
    ("Lots  of\tit ", [0, 6, 10, 13], [0, 4, 8, 12]),
])
def test_word_boundaries(text, starts, stops):
    _, marks = escape_text(text, words=True)
    assert [k for k, m in enumerate(marks) if m & START] == starts
    assert [k for k, m in enumerate(marks) if m & STOP] == stops


def test_characters_bound_values_on_both_sides_without_words():
    _, marks = escape_text("a b ")
    assert list(marks) == [START | STOP] * 5


@pytest.mark.parametrize("text, capital, joined", [
    ("a nurse in Valencia", "A Nurse In Valencia", b"a nurse in Valencia\x00A Nurse In Valencia"),
    ("Oslo, 2026", "Oslo, 2026", b"Oslo, 2026"),               # nothing to capitalise
    ("x\ny-z", "X\nY-z", b"x\\ny-z\x00X\\nY-z"),
])
def test_capitalised_copy_joins_the_text(text, capital, joined):
    assert capitalised(text) == capital
    body, marks = source_tables(text, capitalise=True)
    assert body == joined and len(marks) == len(body) + 1


# -- masks against a brute-force oracle ------------------------------------------------

_STRING = re.compile(rb'"((?:[^"\\]|\\.)*\\?)("?)', re.S)


def _ground_ok(doc: bytes, escaped: bytes, marks: bytes, distinct: bool) -> bool:
    """Whether every string value of the (partial) document ``doc`` is a span of the
    escaped text starting at a boundary (and ending at one when closed), and with
    ``distinct`` no ``,`` follows an item equal to an earlier one. For documents of
    ``STRINGS`` (and of ``RECORD``, whose keys are the strings before a ``:``)."""
    items: list[bytes] = []
    depth, gap = 0, 0          # arrays open; end of the last string
    for m in _STRING.finditer(doc):
        content, closed = m.group(1), m.group(2)
        between = doc[gap:m.start()]
        depth += between.count(b"[") - between.count(b"]")
        gap = m.end()
        item = depth > 0
        if not item and between[-1:] != b":":
            continue                                   # a key
        starts, k = [], escaped.find(content)
        while k >= 0:
            if marks[k] & START:
                starts.append(k)
            k = escaped.find(content, k + 1)
        if closed:
            starts = [k for k in starts if marks[k + len(content)] & STOP]
        else:   # (open: it can still end, at a stop before the next NUL)
            starts = [k for k in starts if any(
                marks[j] & STOP and 0 not in escaped[k + len(content):j]
                for j in range(k + len(content), len(marks)))]
        if not starts:
            return False
        if item and closed and distinct and doc[m.end():m.end() + 1] == b"," and \
                content in items:
            return False
        if item:
            items.append(content)
    return True


def _check_states(compiled, vocab, text: str, distinct: bool, rng: random.Random,
                  walks: int = 4, steps: int = 18, words: bool = False) -> int:
    """Random walks under the grounded mask; at each state, compare every token's bit
    with the oracle (with ``words``: spans of whole words of the text or of its
    capitalised copy). Returns the number of states compared."""
    escaped, marks = source_tables(text, words=words, capitalise=words)
    plan = grounding_plan(compiled.constraint.schema, words=words, capitalise=words)
    compared = 0
    for _ in range(walks):
        m = ground(compiled.matcher(), text, plan, vocab, distinct_items=distinct)
        inner = compiled.matcher()
        doc = b""
        for _ in range(steps):
            inner_ok = _allowed(inner, vocab)
            want = {t for t in inner_ok
                    if t == EOS or _ground_ok(doc + vocab.token_bytes[t], escaped, marks,
                                              distinct)}
            got = _allowed(m, vocab)
            compared += 1
            if not want:                           # nothing grounded left: the schema alone
                assert got == inner_ok
                break
            assert got == want, (text, doc, sorted(got ^ want))
            assert not m.violations
            for t in got:                          # accept takes exactly the mask
                assert m.valid_prefix([t]) == 1
            for t in rng.sample(sorted(set(range(vocab.tokenizer_size)) - got), 8):
                assert m.valid_prefix([t]) == 0
            choices = sorted(got - {EOS})
            if not choices:
                break
            # (closing tokens are few: pick them now and then, so that walks end)
            t = rng.choice(choices)
            assert m.accept(t) and inner.accept(t)
            doc += vocab.token_bytes[t]
    return compared


def _random_text(rng: random.Random) -> str:
    alphabet = "ab ab12é\"\\\n\t"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(3, 14)))


@pytest.mark.parametrize("schema", [STRINGS, RECORD], ids=["strings", "record"])
@pytest.mark.parametrize("distinct, words", [(False, False), (True, False), (False, True)])
def test_mask_admits_exactly_the_text_spans(compiler, tiny_vocab, schema, distinct, words):
    compiled = compiler.compile(JsonSchema(schema), tiny_vocab)
    rng = random.Random(f"{len(json.dumps(schema))}-{distinct}-{words}")
    texts = ["ab", 'say "ab" \\ab', "é\nab\tab", "abab ab"] + [_random_text(rng)
                                                                 for _ in range(6)]
    compared = sum(_check_states(compiled, tiny_vocab, t, distinct, rng, words=words)
                   for t in texts)
    assert compared > 100


_NUMBER = re.compile(rb"-?[0-9.eE+]+|-")


def _numbers_ok(doc: bytes, numbers: frozenset[bytes], distinct: bool) -> bool:
    """Whether every number of the (partial) array document ``doc`` is one of
    ``numbers`` (the last, if nothing follows it yet, a prefix of one), and with
    ``distinct`` no ``,`` follows an item equal in value to an earlier one (1299.00
    repeats 1299.0)."""
    seen: list[float] = []
    for m in _NUMBER.finditer(doc):
        written = m.group()
        if m.end() == len(doc):
            return any(n.startswith(written) for n in numbers)
        if written not in numbers:
            return False
        if distinct and doc[m.end():m.end() + 1] == b"," and float(written) in seen:
            return False
        seen.append(float(written))
    return True


@pytest.mark.parametrize("document, taken", [
    (b"[23.5]", False),         # an integer field takes the text's whole numbers only
    (b"[23]", False),           # and never a decimal's integer part
    (b"[2026,3]", True),
    (b"[13]", True),            # (a date's day: a day field may want it)
    (b"[12]", True),            # 12.00 is whole
])
def test_integer_fields_take_whole_numbers(compiler, tiny_vocab, document, taken):
    schema = {"type": "array", "items": {"type": "integer"}, "maxItems": 3}
    plan = grounding_plan(schema, "strict")
    assert plan.integers == {("*",)}
    m = ground(compiler.compile(JsonSchema(schema), tiny_vocab).matcher(),
               "Paid 23.50 on 2026-06-13 for 3 jars, 12.00 each", plan, tiny_vocab)
    ids = tiny_vocab.segment(document)
    assert (m.valid_prefix(ids) == len(ids)) is taken, document
    if taken:
        assert all(m.accept(t) for t in ids) and m.accept(EOS)


def test_a_number_or_integer_field_takes_decimals():
    schema = {"anyOf": [{"type": "integer"}, {"type": "number"}]}
    assert grounding_plan(schema, "strict").integers == frozenset()


@pytest.mark.parametrize("distinct", [False, True])
@pytest.mark.parametrize("text", ["costs $89.99, not 8.5", "1,299.00 or -5 and 2025-03-08",
                                  "9 99 999", "no digits"])
def test_number_masks_match_the_oracle(compiler, tiny_vocab, text, distinct):
    compiled = compiler.compile(JsonSchema(NUMBERS), tiny_vocab)
    plan = grounding_plan(NUMBERS, "strict")
    numbers = text_numbers(text)
    rng = random.Random(text)
    for _ in range(6):
        m = ground(compiled.matcher(), text, plan, tiny_vocab, distinct_items=distinct)
        inner = compiled.matcher()
        doc = b""
        for _ in range(14):
            inner_ok = _allowed(inner, tiny_vocab)
            want = {t for t in inner_ok
                    if t == EOS or _numbers_ok(doc + tiny_vocab.token_bytes[t], numbers, distinct)}
            got = _allowed(m, tiny_vocab)
            if not want:
                assert got == inner_ok
                break
            assert got == want, (text, doc, sorted(got ^ want))
            choices = sorted(got - {EOS})
            if not choices:
                break
            t = rng.choice(choices)
            assert m.accept(t) and inner.accept(t)
            doc += tiny_vocab.token_bytes[t]


@pytest.mark.parametrize("text, content, allowed", [
    ('He said "hi"', '\\"hi\\"', True),
    ('He said "hi"', '"hi', False),                   # an unescaped quote ends the value
    ("a\\b", "a\\\\b", True),
    ("line\nnext", "line\\nnext", True),
    ("line\nnext", "n", True),
    ("line\nnext", "nnext", False),                   # starts inside the escape "\n"
    ("tab\there", "b\\th", True),
    ("café au lait", "café", True),
    ("café", "caf\\u00e9", False),                    # written otherwise than the text
    ("Oslo", "Oslo", True),
    ("Oslo", "Oslo ", False),
])
def test_escapes_inside_grounded_strings(compiler, tiny_vocab, text, content, allowed):
    compiled = compiler.compile(JsonSchema({"type": "string"}), tiny_vocab)
    m = ground(compiled.matcher(), text, grounding_plan({"type": "string"}), tiny_vocab)
    ids = _ids(tiny_vocab, '"' + content + '"')
    assert (m.valid_prefix(ids) == len(ids)) is allowed


@pytest.mark.parametrize("text, written, allowed", [
    ("costs $89.99", "89.99", True),
    ("costs $89.99", "1.99", False),
    ("costs $89.99", "89.9", False),                  # a prefix, not a number of the text
    ("a 35-year-old", "35", True),
    ("a 35-year-old", "18", False),
    ("a 35-year-old", "-35", False),
    ("total 1,299.00", "1299.00", True),
    ("total 1,299.00", "1299", True),
    ("total 1,299.00", "12990", False),
    ("at -5 C", "-5", True),
])
def test_grounded_numbers(compiler, tiny_vocab, text, written, allowed):
    compiled = compiler.compile(JsonSchema(NUMBERS), tiny_vocab)
    m = ground(compiled.matcher(), text, grounding_plan(NUMBERS, "strict"), tiny_vocab)
    ids = _ids(tiny_vocab, "[" + written + "]")
    assert (m.valid_prefix(ids) == len(ids)) is allowed


def test_number_prefix_may_not_end_before_it_is_whole(compiler, tiny_vocab):
    compiled = compiler.compile(JsonSchema(NUMBERS), tiny_vocab)
    m = ground(compiled.matcher(), "price 89.99", grounding_plan(NUMBERS, "strict"), tiny_vocab)
    for t in _ids(tiny_vocab, "[89.9"):
        assert m.accept(t)
    assert m.valid_prefix(_ids(tiny_vocab, "]")) == 0
    assert m.valid_prefix(_ids(tiny_vocab, "9]")) == 2


# -- distinct items and fallback --------------------------------------------------------

def test_repeated_item_must_end_the_array(compiler, tiny_vocab):
    compiled = compiler.compile(JsonSchema(STRINGS), tiny_vocab)
    m = compiled.grounded_matcher("ab and ba", grounding_plan(STRINGS), distinct_items=True)
    for t in _ids(tiny_vocab, '["ab","ba","ab"'):
        assert m.accept(t)
    allowed = {tiny_vocab.token_bytes[t] for t in _allowed(m, tiny_vocab)}
    assert b"]" in allowed and b"," not in allowed and b",\"" not in allowed
    assert m.accept(_ids(tiny_vocab, "]")[0])
    assert [(r.pointer, r.value) for r in m.repeats] == [("/2", '"ab"')]
    m.rollback(1)
    assert m.repeats == ()


def test_repeat_the_schema_needs_falls_back_and_is_recorded(compiler, tiny_vocab):
    schema = {"type": "array", "items": {"type": "string"}, "minItems": 3}
    compiled = compiler.compile(JsonSchema(schema), tiny_vocab)
    m = compiled.grounded_matcher("ab", grounding_plan(schema), distinct_items=True)
    for t in _ids(tiny_vocab, '["ab","ab"'):
        assert m.accept(t)
    assert m.accept(_ids(tiny_vocab, ",")[0])          # "]" is not allowed yet
    assert [(v.kind, v.pointer, v.value) for v in m.violations] == [("repeat", "/1", '"ab"')]


def test_empty_intersection_falls_back_to_the_schema(compiler, tiny_vocab):
    schema = {"type": "object", "required": ["n"], "additionalProperties": False,
              "properties": {"n": {"type": "integer", "x-grounded": True}}}
    compiled = compiler.compile(JsonSchema(schema), tiny_vocab)
    m = compiled.grounded_matcher("no numbers at all", grounding_plan(schema))
    plain = compiled.matcher()
    for t in _ids(tiny_vocab, '{"n":'):
        assert m.accept(t) and plain.accept(t)
    assert _allowed(m, tiny_vocab) == _allowed(plain, tiny_vocab)
    assert m.accept(_ids(tiny_vocab, "7")[0])
    assert [(v.kind, v.pointer) for v in m.violations] == [("ungrounded", "/n")]
    assert "/n" in m.violations[0].message
    m.rollback(1)
    assert m.violations == ()


# -- rollback, fork, valid_prefix ----------------------------------------------------------

def test_rollback_and_fork_equal_a_fresh_replay(compiler, tiny_vocab):
    compiled = compiler.compile(JsonSchema(RECORD), tiny_vocab)
    text = 'Name: abab "ab", tags ab \\ é'
    plan = grounding_plan(RECORD)
    ids = _ids(tiny_vocab, '{"name":"abab \\"ab\\"","age":1,"tags":["ab","é"]}')
    width = tiny_vocab.bitmask_words
    m = compiled.grounded_matcher(text, plan, distinct_items=True)
    masks = [_mask(m, width)]
    for t in ids:
        assert m.accept(t)
        masks.append(_mask(m, width))
    for k in (1, 4, 9, len(ids)):
        m.rollback(k)
        assert torch.equal(_mask(m, width), masks[len(ids) - k])
        replay = compiled.grounded_matcher(text, plan, distinct_items=True)
        for t in ids[:len(ids) - k]:
            assert replay.accept(t)
        assert torch.equal(_mask(replay, width), masks[len(ids) - k])
        copy = m.fork()
        assert m.valid_prefix(ids[len(ids) - k:]) == k
        for t in ids[len(ids) - k:]:
            assert copy.accept(t)
        assert torch.equal(_mask(copy, width), masks[-1])
        for t in ids[len(ids) - k:]:
            assert m.accept(t)
    assert torch.equal(_mask(m, width), masks[-1])


def test_valid_prefix_cuts_at_the_first_ungrounded_token(compiler, tiny_vocab):
    compiled = compiler.compile(JsonSchema(STRINGS), tiny_vocab)
    m = compiled.grounded_matcher("ab", grounding_plan(STRINGS))
    draft = _ids(tiny_vocab, '["ab","a') + _ids(tiny_vocab, "1")
    assert m.valid_prefix(draft) == len(draft) - 1


def test_forced_tokens_hold_grounding(compiler, tiny_vocab):
    schema = {"type": "object", "required": ["name"], "additionalProperties": False,
              "properties": {"name": {"type": "string"}}}
    compiled = compiler.compile(JsonSchema(schema), tiny_vocab)
    m = compiled.grounded_matcher("ab", grounding_plan(schema))
    forced = m.forced_tokens()
    assert b"".join(tiny_vocab.token_bytes[t] for t in forced) == b'{"name":"'
    assert m.take_forced_tokens(10) == forced
    assert _allowed(m, tiny_vocab) <= {t for t, b in enumerate(tiny_vocab.token_bytes)
                                       if b in (b"a", b"b", b"ab", b'"', b'"}')}


def test_a_plan_of_nothing_leaves_the_mask_alone(compiler, tiny_vocab):
    compiled = compiler.compile(JsonSchema(STRINGS), tiny_vocab)
    m, plain = compiled.grounded_matcher("ab", GroundingPlan()), compiled.matcher()
    for t in _ids(tiny_vocab, '["zz'):
        assert m.accept(t) and plain.accept(t)
    assert _allowed(m, tiny_vocab) == _allowed(plain, tiny_vocab)


# -- the real tokenizer and engine ------------------------------------------------------------

INVOICE = {"type": "object", "additionalProperties": False,
           "required": ["customer", "city", "total", "items"],
           "properties": {"customer": {"type": "string"}, "city": {"type": "string"},
                          "total": {"type": "number", "x-grounded": True},
                          "items": {"type": "array", "maxItems": 4,
                                    "items": {"type": "string"}}}}
INVOICE_TEXT = ("Invoice for Maria Lopez, Calle Mayor 3, Madrid. Items: 2 chairs, a desk lamp "
                "and \"oak\" shelves. Total due: 1,299.50 EUR.")


def test_real_tokenizer_states_match_the_oracle(compiler, smollm2_tokenizer):
    compiled = compiler.compile(JsonSchema(STRINGS), smollm2_tokenizer)
    vocab = compiled.vocab
    text = 'He said "ship it" \\ twice.\nOslo, café'
    escaped, marks = escape_text(text)
    m = compiled.grounded_matcher(text, grounding_plan(STRINGS), distinct_items=True)
    inner = compiled.matcher()
    doc = b""
    for piece in ['["', "He", " said", ' \\"', "ship", '","', "Os", "lo", '","', "He"]:
        inner_ok = _allowed(inner, vocab)
        want = {t for t in inner_ok if t in vocab.eos_token_ids
                or _ground_ok(doc + vocab.token_bytes[t], escaped, marks, True)}
        assert _allowed(m, vocab) == want
        t = vocab.segment(piece.encode())
        assert t is not None and len(t) == 1, piece
        assert m.accept(t[0]) and inner.accept(t[0])
        doc += vocab.token_bytes[t[0]]


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["none", "prompt_lookup"])
def test_engine_output_is_grounded(smollm2_engine, spec):
    import dataclasses

    from formcast.engine import Engine, EngineConfig, SamplingParams
    from formcast.engine.speculative import SpecConfig

    base = smollm2_engine
    engine = Engine(base.model, base.tokenizer,
                    config=EngineConfig(num_kv_blocks=128, enable_prefix_caching=False))
    engine.config = dataclasses.replace(
        engine.config, spec="none" if spec == "none" else SpecConfig(method=spec, scheduled=False))
    compiled = compile_constraint(JsonSchema(INVOICE), base.tokenizer,
                                  vocab_size=base.model.config.vocab_size)
    plan = grounding_plan(INVOICE)
    prompt = base.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Extract the invoice as JSON.\n\n{INVOICE_TEXT}"}],
        add_generation_prompt=True, tokenize=True)
    matchers = [compiled.grounded_matcher(INVOICE_TEXT, plan, distinct_items=True)
                for _ in range(2)]
    params = [SamplingParams(max_tokens=120, temperature=0.0),
              SamplingParams(max_tokens=120, temperature=0.9, seed=3)]
    outs = engine.generate([prompt, prompt], params, constraints=matchers)
    escaped = escape_text(INVOICE_TEXT)[0].decode()
    for out, m in zip(outs, matchers):
        doc = json.loads(out.text)
        assert not m.violations
        for value in [doc["customer"], doc["city"], *doc["items"]]:
            assert json.dumps(value, ensure_ascii=False)[1:-1] in escaped
        total = re.search(r'"total"\s*:\s*([-+.eE0-9]+)', out.text).group(1)
        assert total.encode() in text_numbers(INVOICE_TEXT)
        repeated = len(doc["items"]) - len(set(doc["items"]))
        assert repeated == len(m.repeats) <= 1
    if spec != "none":
        assert sum(o.metrics.num_draft_tokens for o in outs) > 0


def test_batch_fill_equals_row_by_row(compiler, tiny_vocab):
    from formcast.engine.constraint import ops_for

    compiled = compiler.compile(JsonSchema(RECORD), tiny_vocab)
    plan = grounding_plan(RECORD)
    docs = ['{"name":"ab', '{"name":"abab","age":1,"tags":["', '{"name":"', '{']
    matchers = []
    for text, doc in zip(["abab", "abab 1", 'x "ab"', "é"], docs):
        m = compiled.grounded_matcher(text, plan, distinct_items=True)
        for t in _ids(tiny_vocab, doc):
            assert m.accept(t)
        matchers.append(m)
    width = tiny_vocab.bitmask_words
    together = torch.full((len(matchers) + 1, width), -1, dtype=torch.int32)
    ops = ops_for(type(matchers[0]))
    ops.prepare(matchers)
    ops.fill_bitmasks(matchers, together, [3, 0, 4, 1])
    for m, row in zip(matchers, [3, 0, 4, 1]):
        assert torch.equal(together[row], _mask(m, width)[0])


def test_a_fresh_grounded_matcher_travels_to_another_process(compiler, tiny_vocab):
    import pickle

    compiled = compiler.compile(JsonSchema(STRINGS), tiny_vocab)
    m = compiled.grounded_matcher("ab", grounding_plan(STRINGS), distinct_items=True)
    copy = pickle.loads(pickle.dumps(m))
    assert (copy.source_text, copy.plan) == ("ab", m.plan)
    assert _allowed(copy, tiny_vocab) == _allowed(m, tiny_vocab)
    m.accept(_ids(tiny_vocab, "[")[0])
    with pytest.raises(TypeError, match="fresh"):
        pickle.dumps(m)


def test_spans_are_the_wrapped_matchers(compiler, tiny_vocab):
    compiled = compiler.compile(JsonSchema(RECORD), tiny_vocab)
    grounded = compiled.grounded_matcher("ab", grounding_plan(RECORD))
    plain = compiled.matcher()
    ids = _ids(tiny_vocab, '{"name":"ab')
    quote = _ids(tiny_vocab, '"')[0]
    assert type(grounded).span_closing_tokens(tiny_vocab.token_bytes) == \
        type(plain).span_closing_tokens(tiny_vocab.token_bytes)
    for end in range(len(ids) + 1):
        assert grounded.closes_span(ids, 0, end, quote) == plain.closes_span(ids, 0, end, quote)
    assert grounded.closes_span(ids, 0, len(ids), quote)
