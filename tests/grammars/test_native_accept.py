"""The native accept worker: a step's tokens offered to xgrammar matchers outside
the interpreter, from a host buffer, once a poll says they landed."""

from __future__ import annotations

import ctypes
import random

import pytest
import torch

from formcast.grammars import JsonSchema, Regex
from formcast.grammars.backends.xgrammar import XGrammarTuning
from formcast.grammars.backends.xgrammar import ffi, native as native_accept

from .cases import PERSON
from .conftest import EOS, PAD_SPECIAL
from .spies import tuned


def _worker_or_skip():
    if ffi.BATCH_ACCEPT is None:
        pytest.skip(reason="the installed xgrammar has no native batch accept of the known form")
    if native_accept.worker() is None:
        pytest.skip(reason=f"no native accept worker here: {native_accept.unavailable_reason()}")


def _mask(m, compiled) -> torch.Tensor:
    bitmask = compiled.allocate_bitmask(1)
    m.fill_bitmask(bitmask, 0)
    return bitmask[0].clone()


def _host(tokens: list[int], cols: list[int], width: int, dead: int | None = None
          ) -> torch.Tensor:
    """A [2, width] buffer whose column cols[k] holds tokens[k], the rest junk."""
    host = torch.full((2, width), 7, dtype=torch.long)
    host[1] = 0
    for k, c in enumerate(cols):
        host[0, c] = tokens[k]
    if dead is not None:
        host[1, dead] = 1
    return host


def _byte(c: str) -> int:
    return 2 + ord(c)


def test_a_launched_accept_takes_tokens_as_accepting_row_by_row_does(compiler, tiny_vocab):
    """Step after step, the worker's verdicts, and the states and kept texts it
    leaves, are those of ``accept`` row by row, with the columns in any order
    and other columns around them; a step with a stop, special or outside
    token goes the ordinary way (same results); a set dead-end flag in any
    column (offered or not) moves no matcher and answers None."""
    _worker_or_skip()
    person = compiler.compile(JsonSchema(PERSON), tiny_vocab, backend="xgrammar")
    digits = compiler.compile(Regex(r"[0-9]+"), tiny_vocab, backend="xgrammar")
    grammars = [person, digits, digits, person, digits, person]
    batch = [g.matcher() for g in grammars]
    alone = [g.matcher() for g in grammars]
    accept = type(batch[0]).batch_acceptor(batch)
    rng = random.Random(3)
    pool = [_byte(c) for c in '{"name:}1234x, '] + [EOS, PAD_SPECIAL, tiny_vocab.vocab_size - 1]
    width = len(grammars) + 3
    for step in range(40):
        tokens = [rng.choice(pool) for _ in grammars]
        cols = rng.sample(range(width), len(grammars))
        dead = rng.randrange(width) if step % 9 == 4 else None
        job = accept.launch(_host(tokens, cols, width, dead), cols, None)
        got = job.result()
        assert job.done() and job.result() is got
        if dead is not None:
            assert got is None
            continue
        want = []
        for a, t in zip(alone, tokens):
            taken = a.accept(t)
            want.append(0 if not taken else 2 if a.is_terminated() else 1)
        assert got == want
        for b, a, g in zip(batch, alone, grammars):
            assert b.kept_text == a.kept_text
            assert b.is_terminated() == a.is_terminated()
            if not a.is_terminated():
                assert torch.equal(_mask(b, g), _mask(a, g))


def test_a_launched_accept_waits_for_its_poll_and_reports_a_failed_one(compiler, tiny_vocab):
    """The worker polls until the tokens have landed (the poll answers 0),
    offering nothing before; a poll that answers an error fails the accept
    with that code named, and no matcher moves."""
    _worker_or_skip()
    digits = compiler.compile(Regex(r"[0-9]+"), tiny_vocab, backend="xgrammar")
    batch = [digits.matcher() for _ in range(4)]
    accept = type(batch[0]).batch_acceptor(batch)
    calls = []
    answers = {"not yet": 600}

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
    def poll(_arg):
        calls.append(1)
        return answers["not yet"] if len(calls) < 50 else answers.get("then", 0)

    address = ctypes.cast(poll, ctypes.c_void_p).value
    host = _host([_byte("1")] * 4, [0, 1, 2, 3], 4)
    assert accept.launch(host, [0, 1, 2, 3], (address, 0, 600)).result() == [1] * 4
    assert len(calls) >= 50
    calls.clear()
    answers["then"] = 700  # (after 49 not-ready answers, an error)
    job = accept.launch(_host([_byte("x")] * 4, [0, 1, 2, 3], 4), [0, 1, 2, 3],
                        (address, 0, 600))
    with pytest.raises(RuntimeError, match="event query failed.*700"):
        job.result()
    # nothing moved: "x" was never offered, and the next digit is taken
    assert [m.accept(_byte("2")) for m in batch] == [True] * 4


@pytest.mark.parametrize("pauses", [XGrammarTuning().poll_pauses, 4096])
def test_the_poll_interval_is_the_tunings_and_a_longer_one_waits_as_well(compiler, tiny_vocab,
                                                                         pauses):
    """A launched accept's job takes its pauses between two polls from its
    backend's ``XGrammarTuning.poll_pauses`` (a knob for measuring the driver's
    lock, which each poll takes); with more of them the worker still polls
    until the tokens land, then takes them."""
    _worker_or_skip()
    digits = tuned(compiler.compile(Regex(r"[0-9]+"), tiny_vocab, backend="xgrammar"),
                   poll_pauses=pauses)
    batch = [digits.matcher() for _ in range(3)]
    accept = type(batch[0]).batch_acceptor(batch)
    calls = []

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
    def poll(_arg):
        calls.append(1)
        return 600 if len(calls) < 20 else 0

    address = ctypes.cast(poll, ctypes.c_void_p).value
    job = accept.launch(_host([_byte("3")] * 3, [0, 1, 2], 3), [0, 1, 2], (address, 0, 600))
    assert job.job.poll_pauses == pauses
    assert job.result() == [1] * 3 and len(calls) == 20


def test_a_launch_declines_what_the_worker_cannot_take(compiler, tiny_vocab, monkeypatch):
    """No worker, no columns, or columns that do not match the matchers: None
    (the caller checks the tokens itself). A buffer of another shape or type
    is an error that says what it must be."""
    _worker_or_skip()
    digits = compiler.compile(Regex(r"[0-9]+"), tiny_vocab, backend="xgrammar")
    accept = type(digits.matcher()).batch_acceptor([digits.matcher() for _ in range(2)])
    host = _host([_byte("1")] * 2, [0, 1], 2)
    assert accept.launch(host, [0], None) is None
    assert type(digits.matcher()).batch_acceptor([]).launch(host, [], None) is None
    with pytest.raises(ValueError, match=r"\[2, B\] int64"):
        accept.launch(host.int(), [0, 1], None)
    monkeypatch.setattr(native_accept, "_worker", None)
    monkeypatch.setattr(native_accept, "_reason", "not here")
    assert accept.launch(host, [0, 1], None) is None


class _Row:
    """What the engine's acceptor reads of a request: its constraint, its error."""

    def __init__(self, constraint) -> None:
        self.constraint = constraint
        self.error = None


def test_the_engines_acceptor_launches_its_rows_part_and_reports_failures(compiler, tiny_vocab):
    """The engine's acceptor launches the accept of some of a batch's rows (a
    row without a constraint among them) from the step's buffer: the verdicts
    those rows give alone; a failed accept fails every row offered (-1, its
    error set), as the ordinary check does."""
    _worker_or_skip()
    from formcast.engine.constraint_ops import Acceptor as _Acceptor

    digits = compiler.compile(Regex(r"[0-9]+"), tiny_vocab, backend="xgrammar")
    rows = [_Row(digits.matcher()), _Row(None), _Row(digits.matcher()), _Row(digits.matcher())]
    acceptor = _Acceptor()
    host = _host([_byte("1"), 5, _byte("x"), _byte("2")], [0, 1, 2, 3], 4)
    check = acceptor.launch(rows, [0, 2, 3], host, None)
    assert check is not None and check.result() == [1, 0, 1]
    assert acceptor.launch(rows, [0, 1], host, None) is None  # (a row without a constraint)

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
    def broken(_arg):
        return 999

    check = acceptor.launch(rows, [0, 3], host, (ctypes.cast(broken, ctypes.c_void_p).value,
                                                 0, 600))
    assert check.result() == [-1, -1]
    assert "999" in rows[0].error and "999" in rows[3].error and rows[2].error is None


def test_dropped_matchers_are_destroyed_on_the_worker_and_their_memory_comes_back(compiler,
                                                                                   tiny_vocab):
    """A matcher's handle (and a prepared batch's array of them) goes to the
    worker as its Python holder goes: the worker drops those references between
    jobs, xgrammar's destructors run there, and the memory is freed, round
    after round (a leak would add tens of MB a round)."""
    import gc
    import time

    from formcast.grammars.backends.xgrammar import XGrammarMatcher

    _worker_or_skip()
    worker = native_accept.worker()
    compiled = compiler.compile(JsonSchema(PERSON), tiny_vocab, backend="xgrammar")
    opening = [_byte(c) for c in '{"name":"']

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def idle() -> None:
        for _ in range(2000):
            if worker.releases_pending() == 0:
                return
            time.sleep(0.001)
        raise AssertionError("the worker kept references it was handed")

    sizes = []
    for _ in range(5):
        matchers = [compiled.matcher() for _ in range(1500)]
        prepared = XGrammarMatcher.batch_acceptor(
            [m for m in matchers if isinstance(m, XGrammarMatcher)])
        for m in matchers:
            for t in opening:
                assert m.accept(t)
        if prepared.handles is not None:
            assert prepared([_byte("a")] * 1500) == [1] * 1500
        del matchers, prepared
        gc.collect()
        idle()
        sizes.append(rss())
    assert sizes[-1] - sizes[1] < 16 << 20, [s >> 20 for s in sizes]


def test_a_matcher_let_go_never_builds_or_starts_the_worker(compiler, tiny_vocab, monkeypatch):
    """Matchers hand their handles to the worker as they go only when it runs
    (started by an engine that uses it): otherwise they die where they are
    dropped, and no compile or thread starts at a garbage collection."""
    import gc

    compiled = compiler.compile(JsonSchema(PERSON), tiny_vocab, backend="xgrammar")
    monkeypatch.setattr(native_accept, "_worker", None)
    monkeypatch.setattr(native_accept, "_reason", None)
    asked = []
    monkeypatch.setattr(native_accept, "_build", lambda: asked.append(1) or 1 / 0)
    matchers = [compiled.matcher() for _ in range(8)]
    for m in matchers:
        assert m.accept(_byte("{"))
    del matchers, m
    gc.collect()
    assert asked == [] and native_accept._worker is None and native_accept._reason is None
