"""The compile cache (keys, byte bound, failures), the deadline, padded vocabularies."""

from __future__ import annotations

import threading
import time

import pytest

from formcast import ConstraintError
from formcast.grammars import GrammarCompiler, JsonSchema, Regex
from formcast.grammars.cache import ByteBoundedLRU, Failure

from .conftest import allowed_ids


class CountingCompiler(GrammarCompiler):
    """Counts real builds; optionally sleeps in them to miss deadlines."""

    def __init__(self, *, delay_s: float = 0.0, **kw) -> None:
        super().__init__(**kw)
        self.builds = 0
        self.delay_s = delay_s

    def _build(self, *args):
        self.builds += 1
        time.sleep(self.delay_s)
        return super()._build(*args)


def test_same_constraint_compiles_once_per_key(tiny_vocab):
    c = CountingCompiler()
    a = c.compile(Regex("[a-c]+"), tiny_vocab)
    assert c.compile(Regex("[a-c]+"), tiny_vocab) is a
    assert c.builds == 1
    c.compile(Regex("[a-c]+"), tiny_vocab, backend="outlines-core")
    c.compile(JsonSchema({"type": "integer"}), tiny_vocab)
    c.compile(JsonSchema({"type": "integer"}), tiny_vocab)
    c.compile(JsonSchema('{"type":"integer"}'), tiny_vocab)        # same canonical text
    c.compile(JsonSchema({"type": "integer"}, whitespace="flexible"), tiny_vocab)
    assert c.builds == 4
    c.close()


def test_concurrent_compiles_share_one_build(tiny_vocab):
    c = CountingCompiler(delay_s=0.2)
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        c.compile(Regex("x+y"), tiny_vocab))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.builds == 1 and len({id(r) for r in results}) == 1
    c.close()


def test_deadline_raises_then_fails_fast_until_the_build_lands(tiny_vocab):
    c = CountingCompiler(delay_s=0.5, timeout_s=0.1)
    with pytest.raises(ConstraintError, match="longer than 0.1 s"):
        c.compile(Regex("slow+"), tiny_vocab)
    with pytest.raises(ConstraintError, match="longer than"):
        c.compile(Regex("slow+"), tiny_vocab)
    assert c.builds == 1                              # the cached failure, no new build
    deadline = time.monotonic() + 30                  # the first build finishes...
    while True:
        try:
            compiled = c.compile(Regex("slow+"), tiny_vocab)
            break
        except ConstraintError:
            assert time.monotonic() < deadline, "the first build never landed"
            time.sleep(0.05)
    assert compiled.constraint == Regex("slow+")
    assert c.builds == 1                              # ...and its result replaced the failure
    c.close()


def test_a_compile_returns_only_once_its_worker_is_done_with_native_calls(tiny_vocab,
                                                                          monkeypatch):
    """A worker caches its compile (asking the grammar's size, a native call)
    before its caller hears of it, so that a program that compiles and exits
    right away never leaves a worker inside a native call as the interpreter
    shuts down (the daemon thread would be ended in C++ frames: an abort at
    exit). A failed compile is cached first as well."""
    from formcast.grammars.backends.xgrammar import XGrammarGrammar

    returned = threading.Event()
    asked_after: list[bool] = []
    size = XGrammarGrammar.memory_bytes

    def slow_size(self):
        time.sleep(0.3)  # (a caller told before this would have returned by now)
        asked_after.append(returned.is_set())
        return size.fget(self)

    monkeypatch.setattr(XGrammarGrammar, "memory_bytes", property(slow_size))
    c = GrammarCompiler()
    compiled = c.compile(Regex("[a-c]+z"), tiny_vocab, backend="xgrammar")
    returned.set()
    assert asked_after == [False] and c.num_compiling == 0
    assert c.cache.values() == [compiled]
    with pytest.raises(ConstraintError):
        c.compile(Regex("(unclosed"), tiny_vocab, backend="xgrammar")
    assert c.num_compiling == 0 and isinstance(c.cache.values()[-1], Failure)
    c.close()


def test_cache_is_bounded_in_bytes(tiny_vocab):
    # (a grammar counts the masks it may keep for short texts: 5 KB of this vocabulary's)
    c = GrammarCompiler(cache_bytes=16000)
    sizes = []
    for i in range(8):
        sizes.append(c.compile(Regex(f"[a-z]{{{i + 1}}}x"), tiny_vocab).memory_bytes)
        assert c.cache.nbytes <= 16000
    assert 0 < len(c.cache) < 8 and all(s > 0 for s in sizes)
    c.close()


def test_byte_bounded_lru():
    lru = ByteBoundedLRU(100)
    lru.put("a", 1, 40)
    lru.put("b", 2, 40)
    assert lru.get("a") == 1                     # a is now the most recent
    lru.put("c", 3, 40)                          # evicts b
    assert lru.get("b") is None and lru.get("a") == 1 and lru.get("c") == 3
    lru.put("huge", 4, 1000)                     # larger than the budget: not kept
    assert lru.get("huge") is None and lru.nbytes == 80
    lru.put("f", Failure("bad"), 10)
    assert isinstance(lru.get("f"), Failure)
    with pytest.raises(ValueError):
        ByteBoundedLRU(-1)


def test_padded_model_vocabulary(compiler, smollm2_tokenizer):
    width = smollm2_tokenizer.vocab_size + 64
    for backend in ("xgrammar", "outlines-core"):
        compiled = compiler.compile(Regex(r"[^x]{1,3}"), smollm2_tokenizer, backend=backend,
                                    vocab_size=width)
        assert compiled.vocab_size == width
        bitmask = compiled.allocate_bitmask(2)
        assert bitmask.shape == (2, width // 32)
        m = compiled.matcher()
        m.fill_bitmask(bitmask, 1)
        ids = allowed_ids(bitmask, 1, width)
        assert len(ids) > 1000 and ids.max() < smollm2_tokenizer.vocab_size
        assert not m.accept(width - 1)
        special = sorted(smollm2_tokenizer.special_token_ids - smollm2_tokenizer.eos_token_ids)
        assert not set(special) & set(ids.tolist())


def test_vocabulary_of_a_tokenizer_is_cached(compiler, smollm2_tokenizer):
    a = compiler.vocabulary(smollm2_tokenizer)
    assert compiler.vocabulary(smollm2_tokenizer) is a
    assert compiler.vocabulary(smollm2_tokenizer, 49216) is not a
    assert all(a.token_bytes[i] == b"" for i in smollm2_tokenizer.special_token_ids)
    assert a.segment("hello world".encode()) is not None


class StallingCompiler(GrammarCompiler):
    """Builds of regexes starting with "stall" take ``stall_s``; others are real."""

    def __init__(self, *, stall_s: float, **kw) -> None:
        super().__init__(**kw)
        self.stall_s = stall_s

    def _build(self, constraint, *args):
        if constraint.pattern.startswith("stall"):
            time.sleep(self.stall_s)
        return super()._build(constraint, *args)


@pytest.mark.parametrize("spares", [4, 0])
def test_time_behind_compiles_that_missed_their_deadline_is_not_charged(tiny_vocab, spares):
    """With spares a later compile runs at once; without, it waits for a worker, and
    the wait does not count against its deadline either."""
    c = StallingCompiler(stall_s=2.0, timeout_s=0.3, max_workers=2, spare_workers=spares)
    for pattern in ("stall1", "stall2"):           # both workers stay busy for 2 s
        with pytest.raises(ConstraintError, match="longer than"):
            c.compile(Regex(pattern), tiny_vocab)
    assert c.compile(Regex("[a-c]+"), tiny_vocab).constraint == Regex("[a-c]+")
    c.close()


def test_xgrammar_tuning_reaches_the_backend(tiny_vocab):
    from formcast.grammars.backends.xgrammar import XGrammarTuning

    tuning = XGrammarTuning(text_masks=False)
    c = GrammarCompiler(xgrammar_tuning=tuning)
    compiled = c.compile(Regex("[a-c]+"), tiny_vocab)
    assert compiled.grammar.backend.tuning is tuning
    c.close()


@pytest.mark.parametrize("kw", [{"max_workers": 0}, {"spare_workers": -1}])
def test_bad_pool_sizes_are_refused(kw):
    with pytest.raises(ValueError):
        GrammarCompiler(**kw)
