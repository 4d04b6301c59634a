"""Matcher operations: rollback, fork, valid_prefix, forced tokens, accept_text, batch fill."""

from __future__ import annotations

import pickle

import pytest
import torch

from formcast.engine import LogitsConstraint
from formcast.engine.constraint import ops_for
from formcast.grammars import Choice, JsonSchema, Regex, fill_bitmasks

from .cases import PERSON
from .conftest import EOS, PAD_SPECIAL, allowed_ids, matcher_mask, segment_ids
from .spies import FillSpy, tuned

BACKENDS = ["xgrammar", "outlines-core"]


@pytest.fixture(params=BACKENDS)
def person(request, compiler, tiny_vocab):
    return compiler.compile(JsonSchema(PERSON), tiny_vocab, backend=request.param)


def test_matcher_is_an_engine_constraint(person):
    assert isinstance(person.matcher(), LogitsConstraint)


def test_rollback_restores_the_earlier_state(person, tiny_vocab):
    ids = segment_ids(tiny_vocab, '{"name":"Al","age":3')
    m = person.matcher()
    masks = [matcher_mask(m, person)]
    for t in ids:
        assert m.accept(t)
        masks.append(matcher_mask(m, person))
    for k in (1, 3, len(ids) - 2):
        m.rollback(k)
        assert torch.equal(matcher_mask(m, person), masks[len(ids) - k])
        for t in ids[len(ids) - k:]:
            assert m.accept(t)
    assert torch.equal(matcher_mask(m, person), masks[-1])


def test_rollback_past_termination(person, tiny_vocab):
    m = person.matcher()
    for t in segment_ids(tiny_vocab, '{"name":"Al"}'):
        assert m.accept(t)
    assert m.accept(EOS) and m.is_terminated()
    assert not m.accept(EOS)
    m.rollback(1)
    assert not m.is_terminated() and m.is_completed()
    assert m.accept(EOS) and m.is_terminated()


def test_rollback_bounds(person, tiny_vocab):
    m = person.matcher()
    m.rollback(0)
    assert m.accept(segment_ids(tiny_vocab, "{")[0])
    with pytest.raises(ValueError):
        m.rollback(2)


def test_fork_is_independent(person, tiny_vocab):
    m = person.matcher()
    for t in segment_ids(tiny_vocab, '{"name":"A'):
        assert m.accept(t)
    before = matcher_mask(m, person)
    f = m.fork()
    assert torch.equal(matcher_mask(f, person), before)
    for t in segment_ids(tiny_vocab, 'l","age":1}'):
        assert f.accept(t)
    assert f.is_completed() and not m.is_completed()
    assert torch.equal(matcher_mask(m, person), before)
    for t in segment_ids(tiny_vocab, '"}'):
        assert m.accept(t)
    assert m.is_completed()


def test_each_new_matcher_starts_at_the_grammars_start(person, tiny_vocab):
    """Matchers of one compiled grammar are independent whatever the others
    took, finished or rolled back: each new one starts where the first did
    (xgrammar's are copies of one kept at the start)."""
    first = person.matcher()
    start = matcher_mask(first, person)
    for t in segment_ids(tiny_vocab, '{"name":"Al","age":3}'):
        assert first.accept(t)
    assert first.is_completed()
    second = person.matcher()
    assert torch.equal(matcher_mask(second, person), start) and not second.is_completed()
    for t in segment_ids(tiny_vocab, '{"name":"B'):
        assert second.accept(t)
    second.rollback(1)
    third = person.matcher()
    assert torch.equal(matcher_mask(third, person), start)
    assert not third.accept(segment_ids(tiny_vocab, '"')[0])  # (an object opens first)
    for t in segment_ids(tiny_vocab, '{"name":"C","age":5}'):
        assert third.accept(t)
    assert third.is_completed() and first.is_completed() and not second.is_completed()


def test_valid_prefix_leaves_state_unchanged(person, tiny_vocab):
    m = person.matcher()
    good = segment_ids(tiny_vocab, '{"name":"Al"}')
    before = matcher_mask(m, person)
    assert m.valid_prefix(good) == len(good)
    assert m.valid_prefix(good + [EOS, EOS]) == len(good) + 1   # nothing after a stop
    bad = segment_ids(tiny_vocab, '{"name":7}')
    assert m.valid_prefix(bad) == bad.index(segment_ids(tiny_vocab, "7")[0])
    assert m.valid_prefix([EOS]) == 0
    assert m.valid_prefix([]) == 0
    assert torch.equal(matcher_mask(m, person), before) and not m.is_terminated()


@pytest.mark.parametrize("backend", BACKENDS)
def test_forced_tokens_are_accepted_and_spell_the_forced_text(backend, compiler, tiny_vocab):
    compiled = compiler.compile(Choice(["<|im_start|>yes", "<|im_start|>no"]), tiny_vocab,
                                backend=backend)
    m = compiled.matcher()
    forced = m.forced_tokens()
    for t in forced:
        assert m.accept(t)
    text = b"".join(tiny_vocab.token_bytes[t] for t in forced)
    assert b"<|im_start|>".startswith(text)
    if backend == "xgrammar":      # xgrammar forces the whole shared prefix
        assert text == b"<|im_start|>"
    assert m.forced_tokens() == [] or backend == "outlines-core"


def test_forced_tokens_of_a_json_object(compiler, tiny_vocab):
    compiled = compiler.compile(JsonSchema(PERSON), tiny_vocab, backend="xgrammar")
    m = compiled.matcher()
    forced = m.forced_tokens()
    assert b"".join(tiny_vocab.token_bytes[t] for t in forced) == b'{"name":"'
    assert all(m.accept(t) for t in forced)


@pytest.mark.parametrize("backend, constraint, rest", [
    ("xgrammar", JsonSchema(PERSON), 'Ann","age":3}'),
    ("xgrammar", Choice(["<|im_start|>yes", "<|im_start|>no"]), "yes")])
def test_taking_forced_tokens_leaves_the_state_accepting_them_does(backend, constraint, rest,
                                                                    compiler, tiny_vocab):
    """``take_forced_tokens`` (the engine's jump-forward) of a new matcher, its
    shortcut for xgrammar's included, equals accepting ``forced_tokens`` one by
    one: the same tokens, masks and verdicts after, and a second matcher of the
    grammar unaffected; at most ``limit`` are taken (the shortcut then leaves it
    to :meth:`Matcher.take_forced_tokens`, which any backend has)."""
    compiled = compiler.compile(constraint, tiny_vocab, backend=backend)
    by_hand = compiled.matcher()
    forced = by_hand.forced_tokens()
    assert forced and all(by_hand.accept(t) for t in forced)
    opened = matcher_mask(by_hand, compiled)
    taken, other = compiled.matcher(), compiled.matcher()
    assert taken.take_forced_tokens(100) == forced
    assert taken.forced_tokens() == [] and other.forced_tokens() == forced
    assert torch.equal(matcher_mask(taken, compiled), opened)
    assert not torch.equal(matcher_mask(other, compiled), opened)
    for t in segment_ids(tiny_vocab, rest):
        assert taken.accept(t) and by_hand.accept(t)
    assert taken.is_completed() and taken.accept(EOS) and taken.is_terminated()
    again = compiled.matcher()  # (xgrammar: the grammar's opening is found once)
    assert again.take_forced_tokens(len(forced)) == forced
    assert torch.equal(matcher_mask(again, compiled), opened)
    if len(forced) > 1:
        short = compiled.matcher()
        assert short.take_forced_tokens(1) == forced[:1]
        assert short.take_forced_tokens(0) == []
        assert short.forced_tokens() == forced[1:]


def test_an_end_checked_matcher_keeps_the_text_of_the_forced_tokens_it_takes(compiler,
                                                                             tiny_vocab):
    schema = {"type": "object", "required": ["tags"], "additionalProperties": False,
              "properties": {"tags": {"type": "array", "items": {"enum": [1, 2]},
                                      "uniqueItems": True}}}
    compiled = compiler.compile(JsonSchema(schema), tiny_vocab)
    assert compiled.end_check is not None
    m = compiled.matcher()
    opening = b"".join(tiny_vocab.token_bytes[t] for t in m.take_forced_tokens(100))
    assert opening.startswith(b'{"tags"') and b'{"tags":['.startswith(opening)
    for t in segment_ids(tiny_vocab, '{"tags":[1,1]}'[len(opening):]):
        assert m.accept(t)
    assert not m.accept(EOS) and "non-unique" in (m.last_violation or "")
    m.rollback(3)  # back to '{"tags":[1,'
    assert all(m.accept(t) for t in segment_ids(tiny_vocab, "2]}")) and m.accept(EOS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_accept_text_is_one_step(backend, compiler, tiny_vocab):
    compiled = compiler.compile(Regex(r"(ab)+c"), tiny_vocab, backend=backend)
    m = compiled.matcher()
    assert m.accept_text("abab")
    assert not m.accept_text("ac")          # rejected: state unchanged
    assert m.accept_text("c") and m.is_completed()
    m.rollback(1)                           # undoes "c" only
    assert not m.is_completed()
    assert m.accept(segment_ids(tiny_vocab, "c")[0]) and m.accept(EOS) and m.is_terminated()


@pytest.mark.parametrize("backend", BACKENDS)
def test_special_padded_and_early_stop_tokens_are_refused(backend, compiler, tiny_vocab):
    compiled = compiler.compile(Regex(r"[a-z]+"), tiny_vocab, backend=backend)
    m = compiled.matcher()
    assert not m.accept(EOS)                        # nothing generated yet
    assert not m.accept(PAD_SPECIAL)
    assert not m.accept(tiny_vocab.vocab_size - 1)   # a padded id
    assert not m.accept(-1)
    assert m.accept(segment_ids(tiny_vocab, "a")[0]) and m.accept(EOS)


def test_end_checked_matcher_refuses_stop_until_valid(compiler, tiny_vocab):
    schema = {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2, "uniqueItems": True}
    compiled = compiler.compile(JsonSchema(schema), tiny_vocab)
    assert compiled.end_check is not None
    m = compiled.matcher()
    for t in segment_ids(tiny_vocab, "[1,1]"):
        assert m.accept(t)
    mask = matcher_mask(m, compiled)
    assert not (int(mask[EOS >> 5]) >> (EOS & 31)) & 1    # stop masked out: a dead end here
    assert not m.accept(EOS) and not m.is_completed()
    assert "non-unique" in (m.last_violation or "")
    f = m.fork()
    f.rollback(2)                                        # back to "[1,"
    assert f.accept(segment_ids(tiny_vocab, "2")[0]) and f.accept(segment_ids(tiny_vocab, "]")[0])
    assert f.is_completed() and f.accept(EOS) and f.is_terminated()
    assert not m.is_terminated()


def test_end_check_violation_is_known_without_a_mask_fill(compiler, tiny_vocab):
    # the engine may fill masks on a fork (speculative verification) and still has
    # to say why the request's own matcher refuses to end
    schema = {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2, "uniqueItems": True}
    m = compiler.compile(JsonSchema(schema), tiny_vocab).matcher()
    for t in segment_ids(tiny_vocab, "[1,"):
        assert m.accept(t)
    assert m.last_violation is None                      # incomplete: nothing to judge
    for t in segment_ids(tiny_vocab, "1]"):
        assert m.accept(t)
    assert "non-unique" in (m.last_violation or "")
    m.rollback(2)
    assert m.last_violation is None


def test_batch_fill_matches_row_by_row(compiler, tiny_vocab):
    grammars = [compiler.compile(c, tiny_vocab) for c in
                (JsonSchema(PERSON), Regex(r"[0-9]+"), Choice(["x", "y"]))]
    grammars.append(compiler.compile(Regex(r"a+"), tiny_vocab, backend="outlines-core"))
    matchers = [g.matcher() for g in grammars]
    matchers[0].accept(segment_ids(tiny_vocab, "{")[0])
    batch = grammars[0].allocate_bitmask(6)
    fill_bitmasks(matchers, batch, rows=[5, 0, 2, 3])
    for m, row in zip(matchers, [5, 0, 2, 3]):
        one = grammars[0].allocate_bitmask(1)
        m.fill_bitmask(one, 0)
        assert torch.equal(batch[row], one[0])
    assert torch.equal(batch[1], torch.full_like(batch[1], -1))   # untouched rows stay
    # the engine's batch hook on xgrammar matchers fills the same bits
    plain = [m for m in matchers if ops_for(type(m)).fill_bitmasks is not None]
    assert len(plain) >= 3
    hooked = grammars[0].allocate_bitmask(len(plain))
    type(plain[0]).fill_bitmasks(plain, hooked, list(range(len(plain))))
    for i, m in enumerate(plain):
        one = grammars[0].allocate_bitmask(1)
        m.fill_bitmask(one, 0)
        assert torch.equal(hooked[i], one[0])


def test_fill_plan_spreads_costly_batches_and_measures_on_one_thread(compiler, tiny_vocab):
    """xgrammar's batch fill goes to its threads only when one thread's time for the
    batch, estimated from what one thread took last, is long; every PROBE-th such
    batch, and the one after a batch the threads filled fast, is filled on one
    thread again to keep the estimate current. Either way the masks are the
    row-by-row ones."""
    from formcast.grammars.backends.xgrammar import XGrammarMatcher
    from formcast.grammars.backends.xgrammar.fill_plan import FillPlan

    compiled = compiler.compile(JsonSchema(PERSON), tiny_vocab)
    matchers = [compiled.matcher() for _ in range(5)]
    for m, text in zip(matchers, ["", "{", '{"name"', '{"name":"A', '{"name":"Al","age":3']):
        for t in segment_ids(tiny_vocab, text):
            assert m.accept(t)
    expected = compiled.allocate_bitmask(5)
    for i, m in enumerate(matchers):
        m.fill_bitmask(expected, i)
    inner = [getattr(m, "inner", m) for m in matchers]
    assert all(type(m) is XGrammarMatcher for m in inner)
    plan = FillPlan(threads=2)
    calls = []
    for name in ("one", "many"):
        real = getattr(plan, name)
        spy = type("Spy", (), {"batch_fill_next_token_bitmask":
                               lambda self, h, b, r, _real=real, _n=name:
                               (calls.append(_n), _real.batch_fill_next_token_bitmask(h, b, r))})
        setattr(plan, name, spy())

    def fill() -> torch.Tensor:
        got = compiled.allocate_bitmask(5)
        got.zero_()
        plan.fill([m.xgrammar_matcher for m in inner], got, list(range(5)))
        return got

    assert torch.equal(fill(), expected) and calls == ["one"]   # cheap rows: one thread
    assert 0 < plan.us_per_row < 1e5
    plan.us_per_row = 1e6  # as if the rows had turned costly
    for _ in range(plan.probe - 1):
        assert torch.equal(fill(), expected)
    assert calls[1:] == ["many"] * (plan.probe - 1)
    assert torch.equal(fill(), expected) and calls[-1] == "one"   # the probe
    assert plan.us_per_row < 1e5  # measured again
    # a batch the threads fill fast sends the next one to one thread at once
    plan.us_per_row, plan.cheap_us = 1e6, 1e9
    assert torch.equal(fill(), expected) and calls[-1] == "many"
    assert torch.equal(fill(), expected) and calls[-1] == "one"
    assert FillPlan(threads=1).many is None
    # each thread fills through its backend's plan of its own (the engine fills on two at once)
    import threading

    plans, mine = [], compiled.grammar.backend.fill_plans
    worker = threading.Thread(target=lambda: plans.append(mine.get()))
    worker.start()
    worker.join()
    assert plans[0] is not mine.get() and mine.get() is mine.get()


def test_matchers_that_took_the_same_text_share_one_fill(compiler, tiny_vocab):
    """A batch fill fills one matcher per state known shared (one grammar, the
    same text taken, however it was split into tokens or offered) and copies
    its mask to the others' rows; the masks are the row-by-row ones. A matcher
    stops keeping its text after a rollback, a stop token, or past the limit,
    and is then filled on its own; a fork keeps its parent's."""
    from formcast.grammars.backends.xgrammar import XGrammarTuning

    person = compiler.compile(JsonSchema(PERSON), tiny_vocab, backend="xgrammar")
    digits = compiler.compile(Regex(r"[0-9]+"), tiny_vocab, backend="xgrammar")

    def byte(c: str) -> int:  # (a single byte's token)
        return 2 + ord(c)

    def matchers_of(person, digits) -> list:
        text = '{"name"'
        merged, single = segment_ids(tiny_vocab, text), [byte(c) for c in text]
        assert merged != single
        split, whole, offered, fresh, back, longer, fresh2 = (person.matcher() for _ in range(7))
        for t in merged:
            assert whole.accept(t)
        for t in single + [byte(":")]:
            assert longer.accept(t)
        assert offered.accept_text(text)
        # the batch accept keeps texts too: split takes its bytes in three batches
        pair = person.matcher()
        kinds = type(split)
        assert kinds.accept_tokens([split, pair], [byte("{"), byte("{")]) == [1, 1]
        assert kinds.accept_tokens([split, pair], [byte("x"), byte('"')]) == [0, 1]
        for t in single[1:]:
            assert kinds.accept_tokens([split], [t]) == [1]
        assert split.kept_text == whole.kept_text == offered.kept_text == text.encode()
        assert pair.kept_text == b'{"'
        for t in single + [byte(":")]:
            assert back.accept(t)
        back.rollback(1)  # (the state of `whole`, its text no longer known)
        assert back.kept_text is None
        forked = whole.fork()
        assert forked.kept_text == whole.kept_text
        n1, n2 = digits.matcher(), digits.matcher()
        ended = digits.matcher()
        assert ended.accept(byte("7")) and ended.accept(EOS) and ended.kept_text is None
        return [split, whole, offered, fresh, back, longer, fresh2, forked, n1, n2, pair]

    def row_by_row(matchers) -> torch.Tensor:
        expected = person.allocate_bitmask(len(matchers))
        for j, m in enumerate(matchers):
            m.fill_bitmask(expected, j)
        return expected

    # without known masks: xgrammar fills each state once
    plain_person, plain_digits = tuned(person, digits, text_masks=False)
    matchers = matchers_of(plain_person, plain_digits)
    kinds = type(matchers[0])
    expected = row_by_row(matchers)
    spy = FillSpy(plain_person.grammar.backend)
    rows = [12, 0, 3, 5, 1, 7, 2, 9, 11, 4, 8]
    got = person.allocate_bitmask(13)
    got.fill_(-1)
    kinds.fill_bitmasks(matchers, got, rows)
    for j, row in enumerate(rows):
        assert torch.equal(got[row], expected[j]), j
    assert torch.equal(got[6], torch.full_like(got[6], -1)) and torch.equal(got[10], got[6])
    # one fill each: the '{"name"' state, the fresh one, `back`, `longer`, the
    # fresh digits, `pair`
    assert spy.filled == [[12, 5, 1, 7, 11, 8]]
    # the engine's other hook fills each state once and tells each matcher's row
    spy.filled.clear()
    got = person.allocate_bitmask(len(matchers))
    got.fill_(-1)
    index = kinds.fill_distinct_bitmasks(matchers, got)
    assert index == [0, 0, 0, 1, 2, 3, 1, 0, 4, 4, 5] and spy.filled == [[0, 1, 2, 3, 4, 5]]
    for j, at in enumerate(index):
        assert torch.equal(got[at], expected[j]), j
    assert torch.equal(got[6], torch.full_like(got[6], -1))  # (rows past the states)
    back, longer, pair = matchers[4], matchers[5], matchers[10]
    assert kinds.fill_distinct_bitmasks([back, longer, pair], got) is None  # (none shared)
    assert torch.equal(got[2], expected[10]) and torch.equal(got[0], expected[4])
    # with known masks, those of the kept texts that row-by-row fills reached
    # twice are known: xgrammar fills `back`, and `longer` and `pair`, whose
    # texts one fill reached
    known_person, known_digits = tuned(person, digits)
    matchers = matchers_of(known_person, known_digits)
    expected = row_by_row(matchers)
    spy = FillSpy(known_person.grammar.backend)
    got.fill_(-1)
    assert kinds.fill_distinct_bitmasks(matchers, got) == index and spy.filled == [[2, 3, 5]]
    for j, at in enumerate(index):
        assert torch.equal(got[at], expected[j]), j
    # rows in step (one text) read one state; one text in two grammars is two states
    split, whole, offered, fresh, _, _, fresh2, _, n1, n2, _ = matchers
    spy.filled.clear()
    got.fill_(-1)
    assert kinds.fill_distinct_bitmasks([split, whole, offered], got) == [0, 0, 0]
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], torch.full_like(got[1], -1))
    assert kinds.fill_distinct_bitmasks([fresh, n1, fresh2, n2], got) == [0, 1, 0, 1]
    assert torch.equal(got[0], expected[3]) and torch.equal(got[1], expected[8])
    assert spy.filled == []
    # a long text is not kept
    long = digits.matcher()
    assert long.accept_text("1" * XGrammarTuning().text_key_limit) and long.kept_text is not None
    assert long.accept(byte("2")) and long.kept_text is None


@pytest.mark.parametrize("schema,text,redo,fix", [
    # a duplicate item: redo from the duplicate
    ({"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2, "uniqueItems": True},
     "[1,1]", "1]", "2]"),
    # a missing dependent property: redo only the closing brace
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, '{"a":1}', "}", ',"b":2}'),
    # a value the `not` forbids: redo that value
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9,
                                             "not": {"const": 3}}}, "required": ["n"]},
     '{"n":3}', "3}", "4}"),
])
def test_rollback_hint_points_at_the_offending_value(schema, text, redo, fix, compiler,
                                                      tiny_vocab):
    compiled = compiler.compile(JsonSchema(schema), tiny_vocab)
    m = compiled.matcher()
    assert m.rollback_hint() == 0
    for ch in text:                                      # one step per character
        assert m.accept(segment_ids(tiny_vocab, ch)[0])
    assert not m.is_completed()
    hint = m.rollback_hint()
    assert hint == len(redo)
    m.rollback(hint)
    assert m.accept_text(fix) and m.is_completed() and m.rollback_hint() == 0
    assert m.accept(EOS) and m.is_terminated()


@pytest.mark.parametrize("text,path,expect", [
    ('{"a":[1,{"b":"x"}],"c":2}', ["a", 1, "b"], '"x"'),
    ('{"a":[1,{"b":"x"}],"c":2}', ["c"], "2"),
    ('{ "a" : [ 1 , 2 ] }', ["a", 1], "2"),
    ('[[],[3]]', [1], "[3]"),
    ('{"k\\"ey":true}', ['k"ey'], "true"),
    ("7", [], "7"),
])
def test_value_span(text, path, expect):
    from formcast.grammars.json_spans import value_span

    start, end = value_span(text, path)
    assert text[start:end] == expect


def test_a_fresh_matcher_travels_to_another_process_by_its_recipe(compiler, tiny_vocab):
    """Pickled, a fresh matcher of every backend (and an end-checked one) is rebuilt
    from its constraint and vocabulary, with the same masks; a matcher that has
    taken tokens, or one not made by a compiled grammar, refuses."""
    import pickle

    cases = [compiler.compile(JsonSchema(PERSON), tiny_vocab),
             compiler.compile(Regex(r"[0-9]+"), tiny_vocab),
             compiler.compile(Regex(r"a+"), tiny_vocab, backend="outlines-core"),
             compiler.compile(JsonSchema({"type": "array", "items": {"enum": [1, 2]},
                                          "uniqueItems": True}), tiny_vocab)]
    for grammar in cases:
        m = grammar.matcher()
        twin = pickle.loads(pickle.dumps(m))
        assert type(twin) is type(m)
        a, b = grammar.allocate_bitmask(1), grammar.allocate_bitmask(1)
        m.fill_bitmask(a, 0)
        twin.fill_bitmask(b, 0)
        assert torch.equal(a, b)
        allowed = [t for t in range(tiny_vocab.vocab_size) if (int(a[0, t // 32]) >> (t % 32)) & 1]
        assert m.accept(allowed[0])
        with pytest.raises(TypeError, match="fresh"):
            pickle.dumps(m)
        with pytest.raises(TypeError, match="another process"):
            pickle.dumps(m.fork())


def _has_native_batch_accept() -> bool:
    from formcast.grammars.backends.xgrammar import ffi

    return ffi.BATCH_ACCEPT is not None


_NATIVE = pytest.mark.skipif(not _has_native_batch_accept(), reason="the installed "
                             "xgrammar has no native batch accept of the known form")


@pytest.mark.parametrize("way", [pytest.param("native", marks=_NATIVE),
                                 pytest.param("native, read element by element", marks=_NATIVE),
                                 "public"])
def test_batch_accept_hook_matches_row_by_row(compiler, tiny_vocab, way, monkeypatch):
    """The engine's accept hook on xgrammar matchers: the verdicts and the states
    it leaves are those of ``accept`` row by row (refused tokens leave no trace),
    and a stop token that ends a matcher says so; through xgrammar's native batch
    call (its answer read through tvm-ffi's JSON writer when rows were refused,
    or one element at a time) and through its public wrapper."""
    from formcast.grammars.backends.xgrammar import ffi

    if way == "public":  # (as with an xgrammar without the native batch accept)
        monkeypatch.setattr(ffi, "BATCH_ACCEPT", None)
    elif way != "native":
        monkeypatch.setattr(ffi, "STRINGIFY", None)
    person = compiler.compile(JsonSchema(PERSON), tiny_vocab, backend="xgrammar")
    digits = compiler.compile(Regex(r"[0-9]+"), tiny_vocab, backend="xgrammar")
    brace, one = segment_ids(tiny_vocab, "{")[0], segment_ids(tiny_vocab, "1")[0]
    cases = [(person, [], brace, 1), (person, [], one, 0), (digits, [one], EOS, 2),
             (digits, [], EOS, 0), (digits, [], PAD_SPECIAL, 0),
             (digits, [], tiny_vocab.vocab_size - 1, 0), (digits, [], -1, 0),
             (digits, [one], one, 1)]
    hooked, plain = [], []
    for grammar, before, _, _ in cases:
        for group in (hooked, plain):
            m = grammar.matcher()
            for t in before:
                assert m.accept(t)
            group.append(m)
    tokens = [t for _, _, t, _ in cases]
    got = type(hooked[0]).accept_tokens(hooked, tokens)
    assert got == [want for _, _, _, want in cases]
    for h, p, t, want in zip(hooked, plain, tokens, got):
        assert p.accept(t) == bool(want)
        assert h.is_terminated() == p.is_terminated() == (want == 2)
        if want != 2:
            assert torch.equal(matcher_mask(h, person), matcher_mask(p, person))
    # a batch of ordinary tokens only (no stop, special or outside token) takes
    # the one-pass way: the same verdicts and states
    ordinary = [(person, brace, 1), (person, one, 0), (digits, one, 1), (digits, brace, 0)]
    hooked = [grammar.matcher() for grammar, _, _ in ordinary]
    plain = [grammar.matcher() for grammar, _, _ in ordinary]
    tokens = [t for _, t, _ in ordinary]
    assert type(hooked[0]).accept_tokens(hooked, tokens) == [want for _, _, want in ordinary]
    for h, p, t in zip(hooked, plain, tokens):
        p.accept(t)
        assert torch.equal(matcher_mask(h, person), matcher_mask(p, person))
        with pytest.raises(TypeError, match="only a fresh matcher"):  # (it moved)
            pickle.dumps(h)
    # every row taken (the usual batch, told by one containment test)
    fresh = [person.matcher() for _ in range(5)]
    assert type(fresh[0]).accept_tokens(fresh, [brace] * 5) == [1] * 5
    assert all(torch.equal(matcher_mask(m, person), matcher_mask(hooked[0], person)) for m in fresh)


def test_a_batch_accept_keeps_each_rows_text_as_accepting_alone_does(compiler, tiny_vocab):
    """Rows in step (the same text, the same token) share their grown text in a
    batch accept; each row's kept text is still the one ``accept`` row by row
    keeps, through refusals, differing tokens, a stop token and the length limit."""
    from formcast.grammars.backends.xgrammar import XGrammarTuning

    digits = compiler.compile(Regex(r"[0-9]+"), tiny_vocab, backend="xgrammar")

    def byte(c: str) -> int:
        return 2 + ord(c)

    batch = [digits.matcher() for _ in range(6)]
    alone = [digits.matcher() for _ in range(6)]
    accept = type(batch[0]).batch_acceptor(batch)
    steps = [[byte("1")] * 6,
             [byte("2"), byte("2"), byte("3"), byte("x"), byte("2"), byte("3")],
             [byte("4"), EOS, byte("4"), byte("4"), byte("5"), byte("4")]]
    steps += [[byte("9")] * 6] * (XGrammarTuning().text_key_limit + 1)  # (past the limit: none kept)
    kept_before_limit = None
    for k, tokens in enumerate(steps):
        got = accept(tokens)
        for b, a, t, verdict in zip(batch, alone, tokens, got):
            assert a.accept(t) == (verdict > 0)
            assert b.kept_text == a.kept_text
        if k == 2:
            kept_before_limit = [b.kept_text for b in batch]
    assert kept_before_limit == [b"124", None, b"134", b"14", b"125", b"134"]
    assert all(b.kept_text is None for b in batch)


@pytest.mark.parametrize("way", [pytest.param("native", marks=_NATIVE), "public"])
def test_a_prepared_acceptors_subsets_accept_as_their_rows_alone_do(compiler, tiny_vocab, way,
                                                                     monkeypatch):
    """A prepared accept's ``subset`` offers tokens to some of its rows, which
    change from step to step (the rest take theirs another way): each step's
    verdicts, states and kept texts are those of ``accept`` row by row, and
    rows left out do not move."""
    from formcast.grammars.backends.xgrammar import ffi

    if way == "public":
        monkeypatch.setattr(ffi, "BATCH_ACCEPT", None)
    digits = compiler.compile(Regex(r"[0-9]+"), tiny_vocab, backend="xgrammar")
    person = compiler.compile(JsonSchema(PERSON), tiny_vocab, backend="xgrammar")
    one, two, brace, x = (segment_ids(tiny_vocab, c)[0] for c in "12{x")
    grammars = [digits, person, digits, digits, person]
    batch = [g.matcher() for g in grammars]
    alone = [g.matcher() for g in grammars]
    accept = type(batch[0]).batch_acceptor(batch)
    steps = [([0, 2, 3], [one, two, x]),        # row 3 refuses; rows 1 and 4 wait
             ([1, 4], [brace, one]),            # person rows: one taken, one refused
             ([4, 0], [brace, two]),            # not ascending
             ([], []),
             ([0, 1, 2, 3, 4], [one, brace, one, one, brace])]
    for rows, tokens in steps:
        got = accept.subset(rows)(tokens)
        assert got == [int(alone[i].accept(t)) for i, t in zip(rows, tokens)]
        for b, a in zip(batch, alone):
            assert b.kept_text == a.kept_text
            assert torch.equal(matcher_mask(b, person), matcher_mask(a, person))
    with pytest.raises(ValueError, match="2 tokens for 1 matchers"):
        accept.subset([0])([one, one])


@pytest.mark.parametrize("way", [pytest.param("native", marks=_NATIVE), "public"])
def test_a_prepared_batch_acceptor_matches_row_by_row_step_after_step(compiler, tiny_vocab,
                                                                      way, monkeypatch):
    """``batch_acceptor`` prepares the accept of a fixed list of matchers once and
    is called step after step: each step's verdicts and the states it leaves are
    those of ``accept`` row by row, whether the step's tokens are ordinary (one
    native pass), or hold a stop token, a special token or one outside the
    vocabulary (the general way). A step with the wrong number of tokens is an
    error that names the counts, and moves no matcher; no matchers, no verdicts."""
    from formcast.grammars.backends.xgrammar import ffi

    if way == "public":
        monkeypatch.setattr(ffi, "BATCH_ACCEPT", None)
    else:  # (the verdicts are read keeping the interpreter lock; tvm-ffi's own function lets go)
        import tvm_ffi

        assert not ffi.CONTAINS.release_gil
        assert tvm_ffi.get_global_func("ffi.ArrayContains").release_gil
    digits = compiler.compile(Regex(r"[0-9]+"), tiny_vocab, backend="xgrammar")
    person = compiler.compile(JsonSchema(PERSON), tiny_vocab, backend="xgrammar")
    one, two, brace = (segment_ids(tiny_vocab, c)[0] for c in "12{")
    grammars = [digits, digits, person, digits]
    prepared_for = [g.matcher() for g in grammars]
    plain = [g.matcher() for g in grammars]
    accept = type(prepared_for[0]).batch_acceptor(prepared_for)
    for m in prepared_for:  # (prepared: no longer sent to another process as new)
        with pytest.raises(TypeError, match="only a fresh matcher"):
            pickle.dumps(m)
    steps = [[one, brace, brace, two],          # ordinary: taken, refused, taken, taken
             [two, one, one, one],              # ordinary: the refused row takes now
             [one, PAD_SPECIAL, -1, tiny_vocab.vocab_size - 1],  # the general way
             [EOS, one, one, one]]                                # (a stop token: too)
    wanted = [[1, 0, 1, 1], [1, 1, 0, 1], [1, 0, 0, 0], [2, 1, 0, 1]]
    for tokens, want in zip(steps, wanted):
        got = accept(tokens)
        assert got == want
        for h, p, g, t, verdict in zip(prepared_for, plain, grammars, tokens, got):
            assert p.accept(t) == bool(verdict)
            assert h.is_terminated() == p.is_terminated() == (verdict == 2)
            if not h.is_terminated():
                assert torch.equal(matcher_mask(h, g), matcher_mask(p, g))
    with pytest.raises(ValueError, match="3 tokens for 4 matchers"):
        accept([one, one, one])
    for h, p, g in zip(prepared_for, plain, grammars):
        assert h.is_terminated() or torch.equal(matcher_mask(h, g), matcher_mask(p, g))
    assert type(prepared_for[0]).batch_acceptor([])([]) == []




def test_narrow_choice_says_where_the_grammar_allows_few_tokens(compiler, tiny_vocab):
    """An xgrammar matcher says whether its state allows fewer than half of the
    vocabulary's tokens (the opening brace, a key, an integer's digits) or more
    (inside a string): its mask's count, found once for matchers that took the
    same kept text and afresh for one that keeps none; a matcher under an end
    check answers as the one it wraps."""
    compiled = compiler.compile(JsonSchema(PERSON), tiny_vocab, backend="xgrammar")
    text = '{"name":"Al","age":12'
    ids = segment_ids(tiny_vocab, text)
    walkers = [compiled.matcher() for _ in range(3)]
    assert walkers[2].accept(ids[0])
    walkers[2].rollback(1)  # (keeps no text since: fills a mask every time)
    seen = []
    for k, token in enumerate(ids):
        allowed = len(allowed_ids(matcher_mask(walkers[0], compiled)[None], 0, tiny_vocab.vocab_size))
        answers = {m.narrow_choice() for m in walkers}
        assert answers == {2 * allowed < tiny_vocab.tokenizer_size}, (k, allowed)
        seen.append((tiny_vocab.token_bytes[token], answers.pop()))
        for m in walkers:
            assert m.accept(token)
    assert seen[0][1] is True  # (the opening brace)
    inside = [narrow for piece, narrow in seen if piece in (b"A", b"l")]
    assert inside == [False, False]  # (inside the name's string: nearly every token)
    assert seen[-1][1] is True and walkers[0].narrow_choice() is True  # (the age's digits)
    checked = compiler.compile(JsonSchema({"type": "array", "items": {"enum": [1, 2]},
                                           "maxItems": 2, "uniqueItems": True}),
                               tiny_vocab, backend="xgrammar")
    m = checked.matcher()
    assert checked.end_check is not None and m.narrow_choice() is True
    assert m.narrow_choice() == m.inner.narrow_choice()


def test_forces_text_says_where_the_grammar_fixes_the_next_text(compiler, tiny_vocab):
    """An xgrammar matcher says whether its state fixes the next text (the
    opening brace, a required key) or leaves a choice (inside a string, after
    a value): xgrammar's jump-forward string, found once for matchers that
    took the same kept text and found afresh once a matcher keeps none."""
    compiled = compiler.compile(JsonSchema(PERSON), tiny_vocab, backend="xgrammar")
    ids = segment_ids(tiny_vocab, '{"name":"Al"')
    walkers = [compiled.matcher() for _ in range(3)]
    assert walkers[2].accept(ids[0])
    walkers[2].rollback(1)  # (keeps no text since: asks xgrammar every time)
    seen = []
    for k, token in enumerate(ids):
        answers = {m.forces_text() for m in walkers}
        assert answers == {bool(walkers[0].xgrammar_matcher.find_jump_forward_string())}, k
        seen.append(answers.pop())
        for m in walkers:
            assert m.accept(token)
    assert walkers[0].kept_text is not None and walkers[1].kept_text == walkers[0].kept_text
    assert seen[0] is True  # (the opening brace and the required key)
    assert seen[-1] is False  # (inside the name's string)
    assert walkers[0].forces_text() is False  # (after the string: a comma or the brace)
    # a matcher under an end check answers as the one it wraps
    checked = compiler.compile(JsonSchema({"type": "array", "items": {"enum": [1, 2]},
                                           "maxItems": 2, "uniqueItems": True}),
                               tiny_vocab, backend="xgrammar")
    m = checked.matcher()
    assert checked.end_check is not None and m.forces_text() is True  # (the opening bracket)
    assert m.accept(segment_ids(tiny_vocab, "[")[0]) and m.forces_text() is False  # (1 or 2)


def test_xgrammar_matchers_fork_their_start_when_first_used(compiler, tiny_vocab):
    """A grammar's new matcher holds no xgrammar matcher until it is used, or
    offered to ``prepare`` (the engine does, during the prefill); a fork of
    one still at the start waits the same way; each behaves as one forked at
    once."""
    from formcast.grammars.backends.xgrammar import XGrammarMatcher

    person = compiler.compile(JsonSchema(PERSON), tiny_vocab, backend="xgrammar")
    used, prepared = person.matcher(), person.matcher()
    assert isinstance(used, XGrammarMatcher)
    assert not used.forked and not prepared.forked
    start = matcher_mask(used, person)  # (a known mask of the start may serve without a fork)
    assert not used.is_completed()  # (reads xgrammar's state: forks it)
    assert used.forked and not prepared.forked
    XGrammarMatcher.prepare([used, prepared])
    assert prepared.forked and prepared.xgrammar_matcher is not used.xgrammar_matcher
    assert torch.equal(matcher_mask(prepared, person), start)
    lazy = person.matcher().fork()
    assert not lazy.forked
    for m in (used, prepared, lazy):
        for t in segment_ids(tiny_vocab, '{"name":"Al","age":3}'):
            assert m.accept(t)
        assert m.is_completed()
    assert lazy.forked
    # a fork of a matcher that moved copies its state, not the start
    moving = person.matcher()
    for t in segment_ids(tiny_vocab, '{"name":"B'):
        assert moving.accept(t)
    copy = moving.fork()
    assert copy.forked and torch.equal(matcher_mask(copy, person), matcher_mask(moving, person))
    with pytest.raises(ValueError, match="start to fork"):
        XGrammarMatcher(None, frozenset(), 1, frozenset())


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(("text", "token", "taken"), [('{"name":"Al', "i", True),
                                                       ('{"name"', "x", False),
                                                       ('{"name":"Al","age":3', "}", True)])
def test_an_xgrammar_matcher_answers_alike_through_native_or_public_calls(
        compiler, tiny_vocab, monkeypatch, native, text, token, taken):
    """A matcher's per-token calls go to xgrammar's native methods where this
    xgrammar has the ones known, else to its public ones: masks, verdicts and
    completion are the same either way, and xgrammar's own."""
    import xgrammar as xgr

    from formcast.grammars.backends.xgrammar import ffi

    if native and not ffi.NATIVE_MATCHER_CALLS:
        pytest.skip(reason="this xgrammar's native matcher methods are not the known ones")
    monkeypatch.setattr(ffi, "NATIVE_MATCHER_CALLS", native)
    person = compiler.compile(JsonSchema(PERSON), tiny_vocab, backend="xgrammar")
    m = person.matcher()
    ref = xgr.GrammarMatcher(person.grammar.compiled)
    for t in segment_ids(tiny_vocab, text):
        assert m.accept(t) and ref.accept_token(t)
    got, want = person.allocate_bitmask(1), person.allocate_bitmask(1)
    m.fill_bitmask(got, 0)
    ref.fill_next_token_bitmask(want, 0)
    assert torch.equal(got, want)
    t = segment_ids(tiny_vocab, token)[0]
    assert m.accept(t) == ref.accept_token(t) == taken
    assert m.is_completed() == ref.is_completed() == (token == "}" and taken)
