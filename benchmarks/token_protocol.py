"""The token-level protocol the JSON Schema benchmarks share, and the systems it drives.

A system compiles a JSON Schema for SmolLM2's tokenizer and makes matchers; an
instance is *accepted* when, token by token, each token's bit is set in the mask the
matcher fills and the matcher takes it, and after the last token the end-of-sequence
token is allowed by the mask and taken. Systems: formcast (its public API), raw
xgrammar (the library formcast wraps, given the same vocabulary formcast builds), and
llguidance when it is installed.
"""

from __future__ import annotations

import json
import resource
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from formcast import grammars
from formcast.engine import load_tokenizer
from formcast.grammars import ConstraintError, Vocabulary


def compact(instance: Any) -> str:
    """The instance as compact JSON text, the protocol's serialization."""
    return json.dumps(instance, separators=(",", ":"), ensure_ascii=False)


class StreamMatcher(Protocol):
    """What the protocol needs of one system's matcher."""

    def fill(self, bitmask: torch.Tensor) -> None: ...   # row 0 of an int32 [1, words] mask
    def accept(self, token: int) -> bool: ...


class CompileFailure(Exception):
    """A schema a system refused, or that missed the compile deadline."""


@dataclass(frozen=True)
class Verdict:
    """Whether an instance went through, and if not, where it stopped."""

    accepted: bool
    reason: str = ""
    at_token: int = -1        # the token that failed; len(tokens) for end-of-sequence


def bit_set(bitmask: torch.Tensor, token: int) -> bool:
    """Whether ``token`` is allowed in row 0 of a packed int32 mask."""
    return bool((int(bitmask[0, token >> 5]) >> (token & 31)) & 1)


def run_instance(matcher: StreamMatcher, tokens: list[int], eos: int, bitmask: torch.Tensor,
                 decode: Callable[[list[int]], str]) -> Verdict:
    """Drive ``matcher`` through ``tokens`` then end-of-sequence; see the module doc."""
    for i, token in enumerate(tokens):
        try:
            matcher.fill(bitmask)
            allowed = bit_set(bitmask, token)
            taken = allowed and matcher.accept(token)
        except Exception as exc:  # a library error is a rejection with its reason
            return Verdict(False, f"error at token {i}: {type(exc).__name__}: {exc}", i)
        if not taken:
            where = "masked out" if not allowed else "mask allowed it, accept refused"
            return Verdict(False, f"token {i} {decode([token])!r} after "
                                  f"{decode(tokens[:i])[-40:]!r}: {where}", i)
    try:
        matcher.fill(bitmask)
        if not bit_set(bitmask, eos) or not matcher.accept(eos):
            return Verdict(False, "end-of-sequence not allowed after the last token",
                           len(tokens))
    except Exception as exc:
        return Verdict(False, f"error at end: {type(exc).__name__}: {exc}", len(tokens))
    return Verdict(True)


def with_deadline(fn: Callable[[], Any], seconds: float) -> Any:
    """``fn()`` on a daemon thread; CompileFailure if it takes longer than ``seconds``.

    A native compile cannot be stopped: past the deadline it is left running.
    """
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller below
            box["error"] = exc

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise CompileFailure(f"compile missed the {seconds:g} s deadline")
    if "error" in box:
        error = box["error"]
        raise CompileFailure(f"{type(error).__name__}: {error}".strip()) from error
    return box["value"]


class System:
    """One library under test: ``compile`` a schema, then ``matcher`` per instance."""

    name = "system"

    def compile(self, schema: Any) -> Any:
        """A compiled handle, or CompileFailure."""
        raise NotImplementedError

    def matcher(self, compiled: Any) -> StreamMatcher:
        raise NotImplementedError

    def timed_compile(self, schema: Any, cpu_budget: float | None = None) -> tuple[Any, float]:
        """(handle, seconds) or CompileFailure.

        With ``cpu_budget``, seconds are the process's CPU time over the compile (every
        compile runs on this process's threads, one at a time) and a compile over the
        budget is a miss: a deadline a busy machine does not move.
        """
        start, cpu = time.perf_counter(), _cpu_seconds()
        compiled = self.compile(schema)
        if cpu_budget is None:
            return compiled, time.perf_counter() - start
        used = _cpu_seconds() - cpu
        if used > cpu_budget:
            raise CompileFailure(f"compile used {used:.1f} s of CPU, over the "
                                 f"{cpu_budget:g} s budget")
        return compiled, used


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _FormcastMatcher:
    __slots__ = ("fill_row", "accept")

    def __init__(self, matcher: grammars.Matcher) -> None:
        # readied as the engine readies a new request's (xgrammar's matcher is
        # then made, as RawXGrammar's is, before the first token)
        type(matcher).prepare([matcher])
        fill = matcher.fill_bitmask
        self.fill_row = fill
        self.accept = matcher.accept

    def fill(self, bitmask: torch.Tensor) -> None:
        self.fill_row(bitmask, 0)


class Formcast(System):
    """formcast through its public API: ``compile(JsonSchema(schema), tok).matcher()``."""

    def __init__(self, tokenizer: Any, *, strict: bool, deadline_s: float) -> None:
        self.tokenizer = tokenizer
        self.deadline_s = deadline_s
        # a compiler of its own: every compile is a cache miss, none shares a worker
        self.compiler = grammars.GrammarCompiler(timeout_s=deadline_s)
        self.strict_applied = strict
        try:
            grammars.JsonSchema({}, strict=strict)
            self.options: dict[str, Any] = {"strict": strict}
        except TypeError:   # a formcast without the option: objects are closed
            self.options = {}
            self.strict_applied = True
        self.name = "formcast" if self.strict_applied == strict else "formcast (closed objects)"
        self.compiler.compile(grammars.JsonSchema({"type": "null"}), tokenizer)  # vocabulary set-up

    def compile(self, schema: Any) -> grammars.CompiledGrammar:
        try:
            return self.compiler.compile(grammars.JsonSchema(schema, **self.options),
                                         self.tokenizer, timeout_s=self.deadline_s)
        except (ConstraintError, ValueError, TypeError, RecursionError) as exc:
            raise CompileFailure(f"{type(exc).__name__}: {exc}") from exc

    def matcher(self, compiled: grammars.CompiledGrammar) -> _FormcastMatcher:
        return _FormcastMatcher(compiled.matcher())


class _XGrammarMatcher:
    __slots__ = ("fill_row", "accept")

    def __init__(self, matcher: Any) -> None:
        self.fill_row = matcher.fill_next_token_bitmask
        self.accept = matcher.accept_token

    def fill(self, bitmask: torch.Tensor) -> None:
        self.fill_row(bitmask, 0)


class RawXGrammar(System):
    """xgrammar used directly, on the vocabulary formcast builds for the tokenizer."""

    name = "xgrammar (raw)"

    def __init__(self, vocab: Vocabulary, *, strict: bool, deadline_s: float) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.strict = strict
        self.deadline_s = deadline_s
        info = xgr.TokenizerInfo(list(vocab.token_bytes), xgr.VocabType.RAW,
                                 vocab_size=vocab.vocab_size,
                                 stop_token_ids=sorted(vocab.eos_token_ids),
                                 add_prefix_space=False)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def compile(self, schema: Any) -> Any:
        def build() -> Any:
            grammar = self.xgr.Grammar.from_json_schema(
                json.dumps(schema), any_whitespace=False, separators=(",", ":"),
                strict_mode=self.strict)
            return self.compiler.compile_grammar(grammar)
        return with_deadline(build, self.deadline_s)

    def matcher(self, compiled: Any) -> _XGrammarMatcher:
        return _XGrammarMatcher(self.xgr.GrammarMatcher(compiled))


class _LLGuidanceMatcher:
    __slots__ = ("matcher", "accept")

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.accept = matcher.consume_token

    def fill(self, bitmask: torch.Tensor) -> None:
        self.matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.shape[1] * 4)
        if self.matcher.is_error():
            raise RuntimeError(self.matcher.get_error())


class LLGuidance(System):
    """llguidance used directly, with the same token bytes and stop token."""

    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab: Vocabulary, *, strict: bool,
                 deadline_s: float) -> None:
        import llguidance

        self.llg = llguidance
        self.strict = strict
        self.deadline_s = deadline_s

        class _Wrapped:   # the shape llguidance.TokenizerWrapper reads
            eos_token_id = min(vocab.eos_token_ids)
            bos_token_id = None
            tokens = list(vocab.token_bytes)
            special_token_ids = sorted(set(getattr(tokenizer, "special_token_ids", ())))

            def __call__(self, text: bytes | str) -> list[int]:
                if isinstance(text, bytes):
                    text = text.decode("utf-8", errors="replace")
                return tokenizer.encode(text, add_special_tokens=False)

        self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrapped()),
                                                n_vocab=vocab.vocab_size)

    def compile(self, schema: Any) -> Any:
        # not "lenient": a keyword llguidance cannot enforce is then a compile error
        options = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}

        def build() -> str:
            grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
            is_error, messages = self.llg.LLMatcher.validate_grammar_with_warnings(
                grammar, self.tokenizer)
            if is_error:
                raise ValueError(messages[0] if messages else "invalid grammar")
            return grammar
        return with_deadline(build, self.deadline_s)

    def matcher(self, compiled: str) -> _LLGuidanceMatcher:
        matcher = self.llg.LLMatcher(self.tokenizer, compiled, log_level=0)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return _LLGuidanceMatcher(matcher)


@dataclass
class Setup:
    """SmolLM2's tokenizer, formcast's vocabulary of it, and the systems to compare."""

    tokenizer: Any
    vocab: Vocabulary
    systems: list[System]
    notes: list[str]

    @property
    def eos(self) -> int:
        return min(self.vocab.eos_token_ids)

    def tokens(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def exact_tokens(self, text: str) -> list[int] | None:
        """The tokens of ``text``, or None when they do not decode back to it (characters
        the tokenizer cannot write): such a stream is another document."""
        tokens = self.tokens(text)
        return tokens if self.decode(tokens) == text else None

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def bitmask(self) -> torch.Tensor:
        return torch.zeros(1, self.vocab.bitmask_words, dtype=torch.int32)


def setup(*, strict: bool, deadline_s: float, llguidance: bool = True) -> Setup:
    """Load SmolLM2's tokenizer and build formcast, raw xgrammar and (if present) llguidance."""
    tokenizer = load_tokenizer("smollm2")
    vocab = Vocabulary.from_tokenizer(tokenizer)
    fc = Formcast(tokenizer, strict=strict, deadline_s=deadline_s)
    systems: list[System] = [fc, RawXGrammar(vocab, strict=strict, deadline_s=deadline_s)]
    notes = [f"objects: {'closed (strict)' if strict else 'open, as the spec says (strict=False)'}"]
    if fc.strict_applied != strict:
        notes.append("this formcast has no JsonSchema(strict=...): its objects stay closed, "
                     "so valid instances with extra properties are rejected")
    if llguidance:
        try:
            systems.append(LLGuidance(tokenizer, vocab, strict=strict, deadline_s=deadline_s))
        except ImportError:
            notes.append("llguidance is not installed (pip install llguidance): skipped")
    return Setup(tokenizer, vocab, systems, notes)
