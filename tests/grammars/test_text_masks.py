"""Masks known by text: a batch of xgrammar matchers whose kept texts have known
masks takes its tokens on those masks' bits, xgrammar catching up on the native
worker; whatever reads a matcher's state waits for it."""

from __future__ import annotations

import pytest
import torch

from formcast.grammars import GrammarCompiler, JsonSchema
from formcast.grammars.backends.xgrammar import ffi, native as native_accept

from .cases import PERSON
from .conftest import EOS, PAD_SPECIAL
from .spies import known_mask_calls, tuned


def byte(c: str) -> int:  # (a single byte's token in the synthetic vocabulary)
    return 2 + ord(c)


@pytest.fixture()
def person(tiny_vocab):
    """PERSON on xgrammar, from a backend of its own: the masks it learns (and
    the one a test corrupts) stay with it. Batches of any size take the known
    masks' way here (``XGrammarTuning.known_min_rows`` 1; by default 16)."""
    if ffi.BATCH_ACCEPT is None or native_accept.worker() is None:
        pytest.skip(reason="needs xgrammar's native batch accept and the native worker: "
                    f"{native_accept.unavailable_reason()}")
    compiler = GrammarCompiler(timeout_s=60.0)
    yield tuned(compiler.compile(JsonSchema(PERSON), tiny_vocab, backend="xgrammar"),
                known_min_rows=1)
    native_accept.worker().backlog.settle()
    compiler.close()


def _at(person, text: str):
    m = person.matcher()
    for c in text:
        assert m.accept(byte(c))
    return m


def _mask(m, person) -> torch.Tensor:
    bitmask = person.allocate_bitmask(1)
    m.fill_bitmask(bitmask, 0)
    return bitmask[0].clone()


def _learn(m, person) -> None:
    """Fill ``m``'s mask through its class's batch fill, which keeps the mask of
    its text at once."""
    type(m).fill_bitmasks([m], person.allocate_bitmask(1), [0])


def _state_mask(m, person) -> torch.Tensor:
    """The mask of the state xgrammar's matcher is in (no known mask read)."""
    bitmask = person.allocate_bitmask(1)
    m.xgrammar_matcher.fill_next_token_bitmask(bitmask, 0)
    return bitmask[0].clone()


@pytest.mark.parametrize("text", ["", "{", '{"na', '{"name":"', '{"name":"Al'])
def test_known_masks_judge_every_token_as_xgrammar_does(person, tiny_vocab, monkeypatch, text):
    """Every token of the vocabulary offered in a state whose text has a known
    mask: the verdicts are xgrammar's own, and once the worker is through each
    matcher is in the state xgrammar's own accept leaves (its mask, its
    completion, its next accept)."""
    seen = known_mask_calls(monkeypatch)
    special = {EOS, PAD_SPECIAL} | set(range(289, 320))
    tokens = [t for t in range(320) if t not in special]
    ref = _at(person, text)
    _learn(ref, person)  # (its text's mask now known)
    width = person.allocate_bitmask(1).shape[1]
    assert person.grammar.text_masks.row(text.encode(), width) is not None
    matchers = [_at(person, text) for _ in tokens]
    kind = type(ref)
    got = kind.accept_tokens(matchers, tokens)
    assert seen == [True]
    expected = []
    for t in tokens:
        fork = ref.fork()
        expected.append(int(fork.accept(t)))
    assert got == expected and 0 < sum(got) < len(tokens)
    for m, t, verdict in zip(matchers, tokens, got):
        fork = ref.fork()
        if verdict:
            assert fork.accept(t)
            assert m._pending > 0 and m.kept_text == fork.kept_text
        assert torch.equal(_state_mask(m, person), _state_mask(fork, person)), t
        assert m.is_completed() == fork.is_completed()


@pytest.mark.parametrize(("fills", "known"), [(1, False), (2, True), (3, True)])
def test_a_single_fill_keeps_the_mask_of_a_text_a_fill_reached_before(person, fills, known):
    """Matchers filling their rows one by one: a text's mask is kept once a
    second fill reaches it (most texts are reached once), and a kept mask is
    the one xgrammar fills."""
    text = '{"name":"'
    width = person.allocate_bitmask(1).shape[1]
    for k in range(fills):
        assert (person.grammar.text_masks.row(text.encode(), width) is None) == (k < 2)
        _mask(_at(person, text), person)
    assert (person.grammar.text_masks.row(text.encode(), width) is not None) == known
    m = _at(person, text)
    assert torch.equal(_mask(m, person), _state_mask(m, person))


def test_a_row_without_a_known_mask_is_offered_by_xgrammar_beside_the_known(person, monkeypatch):
    """A batch of rows with and without known masks: the known rows are judged by
    their masks, the others by xgrammar (after the worker took their earlier
    tokens), every verdict as xgrammar's."""
    seen = known_mask_calls(monkeypatch)
    known = _at(person, "{")
    _learn(known, person)
    rows = [_at(person, "{"), _at(person, '{"n'), _at(person, "{"), _at(person, '{"n')]
    kind = type(known)
    assert kind.accept_tokens(rows, [byte('"'), byte("a"), byte("x"), byte("b")]) == [1, 1, 0, 0]
    assert seen == [False, True]  # (the unknown rows: their part, by xgrammar, inside)
    assert [m.kept_text for m in rows] == [b'{"', b'{"na', b"{", b'{"n']
    assert kind.accept_tokens(rows, [byte("n"), byte("m"), byte('"'), byte("m")]) == [1, 1, 1, 0]
    assert [m.kept_text for m in rows] == [b'{"n', b'{"nam', b'{"', b'{"n']


def test_rollback_and_fork_wait_for_the_worker(person, monkeypatch):
    """Tokens taken on known masks, then a rollback and a fork: the states are
    those of the same tokens taken one by one."""
    text = '{"name":"'
    rows = [person.matcher() for _ in range(3)]
    ref = person.matcher()
    kind = type(ref)
    seen = known_mask_calls(monkeypatch)
    for c in text:  # the first pass learns the masks, the second takes the known way
        _learn(ref, person)
        assert ref.accept(byte(c))
    for c in text:
        assert kind.accept_tokens(rows, [byte(c)] * 3) == [1, 1, 1]
    assert seen == [True] * len(text) and rows[0]._pending > 0
    rows[0].rollback(2)
    ref.rollback(2)
    assert rows[0].kept_text is None
    assert torch.equal(_mask(rows[0], person), _mask(ref, person))
    fork = rows[1].fork()
    assert fork.kept_text == text.encode()
    assert torch.equal(_mask(fork, person), _mask(rows[2], person))
    assert rows[2].accept_text("Bo") and rows[2].kept_text == b'{"name":"Bo'


def test_a_known_mask_that_xgrammar_disagrees_with_breaks_only_its_matcher(person, monkeypatch):
    """A known mask that allows a token xgrammar refuses (corrupted here; never
    seen in use): the matcher that took it on the mask is broken once the worker
    is through, and says so wherever it is used, its request failing with the
    reason; the other rows of the batch go on."""
    seen = known_mask_calls(monkeypatch)
    ref = _at(person, "{")
    _learn(ref, person)
    masks = person.grammar.text_masks
    at = masks.row(b"{", person.allocate_bitmask(1).shape[1])
    bad = byte("x")
    masks.rows[at, bad >> 5] |= 1 << (bad & 31)
    rows = [_at(person, "{") for _ in range(3)]
    kind = type(ref)
    assert kind.accept_tokens(rows, [bad, byte('"'), byte('"')]) == [1, 1, 1]
    assert seen == [True]
    native_accept.worker().backlog.settle()
    assert not rows[1].is_completed()  # (its state is its text's; the broken one raises)
    for use in (lambda m: _mask(m, person), lambda m: m.is_completed(), lambda m: m.rollback(1),
                lambda m: m.fork()):
        with pytest.raises(RuntimeError, match="refused token"):
            use(rows[0])
    # the batch's next accept: -1 (the constraint failed) for the broken row alone
    assert kind.accept_tokens(rows, [byte("a"), byte("n"), byte("n")]) == [-1, 1, 1]
    assert rows[1].kept_text == rows[2].kept_text == b'{"n'


def test_a_batch_of_fewer_rows_than_the_threshold_is_offered_by_xgrammar(person, monkeypatch):
    """Fewer rows than ``XGrammarTuning.known_min_rows`` (a few masked rows among
    a large batch's unmasked ones) are offered to xgrammar here, known masks or not."""
    seen = known_mask_calls(monkeypatch)
    person = tuned(person, known_min_rows=3)
    known = _at(person, "{")
    _learn(known, person)
    kind = type(known)
    assert kind.accept_tokens([_at(person, "{") for _ in range(2)], [byte('"')] * 2) == [1, 1]
    assert seen == []
    assert kind.accept_tokens([_at(person, "{") for _ in range(3)], [byte('"')] * 3) == [1, 1, 1]
    assert seen == [True]


def test_tidy_lets_go_of_the_batches_the_worker_is_through_with(person, monkeypatch):
    """The engine's hook while it waits for the device: the batches taken on
    known masks that the worker is done with are checked and dropped (with
    their references to the matchers); the matchers' states are unchanged."""
    import time

    text = '{"name":"'
    ref = _at(person, "")
    for c in text:  # (the masks of the text's prefixes known)
        _learn(ref, person)
        assert ref.accept(byte(c))
    kind = type(ref)
    rows = [person.matcher() for _ in range(4)]
    for c in text:
        assert kind.accept_tokens(rows, [byte(c)] * 4) == [1] * 4
    backlog = native_accept.worker().backlog
    assert backlog.queue
    for _ in range(2000):  # (until the worker is through: done_only checks no others)
        if all(p.job.state != native_accept.QUEUED for p in backlog.queue):
            break
        time.sleep(0.001)
    kind.tidy()
    assert not backlog.queue and backlog.settled == backlog.last
    assert all(torch.equal(_mask(m, person), _mask(ref, person)) for m in rows)


@pytest.mark.parametrize("token", ['"', "x"])
def test_rows_in_step_offered_one_token_are_judged_once_as_xgrammar_judges(person, monkeypatch,
                                                                            token):
    """A batch's opening: every row at one text, every row offered one token. The
    verdicts, texts and states are xgrammar's, the token taken (or refused) by
    all alike."""
    seen = known_mask_calls(monkeypatch)
    ref = _at(person, "{")
    _learn(ref, person)
    rows = [_at(person, "{") for _ in range(5)]
    want = int(ref.fork().accept(byte(token)))
    kind = type(ref)
    assert kind.accept_tokens(rows, [byte(token)] * len(rows)) == [want] * len(rows)
    assert seen == [True]
    fork = ref.fork()
    if want:
        assert fork.accept(byte(token))
    assert {m.kept_text for m in rows} == {fork.kept_text}
    # an unknown text in step: xgrammar judges the rows
    unknown = [_at(person, '{"nam') for _ in range(3)]
    assert kind.accept_tokens(unknown, [byte("e")] * 3) == [1, 1, 1]
    assert seen[-1] is False and {m.kept_text for m in unknown} == {b'{"name'}
    for m in rows:
        assert torch.equal(_state_mask(m, person), _state_mask(fork, person))
