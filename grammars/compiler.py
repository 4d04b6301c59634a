"""Compiling constraints: front end, backend choice, cache and deadline.

Lifecycle (as in xgrammar): tokenizer -> :class:`Vocabulary` -> :class:`GrammarCompiler`
(cached, thread pool) -> immutable :class:`CompiledGrammar` -> cheap per-request
:class:`~formcast.grammars.matcher.Matcher`.
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from typing import TYPE_CHECKING

import torch

from formcast.grammars.errors import ConstraintError
from formcast.grammars.backends.base import Backend, BackendGrammar
from formcast.grammars.bitmask import allocate_bitmask
from formcast.grammars.cache import ByteBoundedLRU, Failure
from formcast.grammars.constraints import Constraint
from formcast.grammars.grammar_check import check_grammar
from formcast.grammars.end_violation import EndCheck
from formcast.grammars.matcher import EndCheckedMatcher, Matcher
from formcast.grammars.native_log import native_log
from formcast.grammars.schema_coverage import SchemaCoverage
from formcast.grammars.source import grammar_source
from formcast.grammars.vocab import TokenizerLike, Vocabulary

if TYPE_CHECKING:     # importing it loads xgrammar, which a compiler may never use
    from formcast.grammars.backends.xgrammar.tuning import XGrammarTuning
    from formcast.grammars.grounded_matcher import GroundedMatcher
    from formcast.grammars.grounding import GroundingPlan

BACKENDS = ("xgrammar", "outlines-core")
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_CACHE_BYTES = 512 << 20
_FAILURE_BYTES = 1024          # what a cached failure is charged
_MAX_BACKENDS = 8              # per-vocabulary backend instances kept


def _backend_class(name: str) -> type[Backend]:
    if name == "xgrammar":
        from formcast.grammars.backends.xgrammar import XGrammarBackend
        return XGrammarBackend
    if name == "outlines-core":
        from formcast.grammars.backends.outlines_backend import OutlinesBackend
        return OutlinesBackend
    raise ValueError(f"unknown grammar backend {name!r}; choose 'auto' or one of {BACKENDS}")


class _Job:
    """A queued compile: its future and when a worker took it up."""

    __slots__ = ("future", "fn", "args", "started", "started_at", "abandoned")

    def __init__(self, fn: Callable, args: tuple) -> None:
        self.future: cf.Future = cf.Future()
        self.fn = fn
        self.args = args
        self.started = threading.Event()
        self.started_at = 0.0
        self.abandoned = False


class _DaemonPool:
    """Worker threads that never keep the process alive.

    A compile that misses its deadline cannot be stopped (it runs in C++); on daemon
    threads it at least does not block interpreter exit, as a ThreadPoolExecutor's
    joined workers would. Its caller gives it up (:meth:`abandon`) and a spare thread
    takes its place, so that later compiles do not queue behind it; at most
    ``spares`` such threads run at once.
    """

    def __init__(self, workers: int, spares: int) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._workers = workers
        self._spares = spares
        self._live = 0            # threads started and not yet ended
        self._abandoned = 0       # jobs given up by their callers, still running
        self._lock = threading.Lock()

    def _wanted(self) -> int:
        return self._workers + min(self._abandoned, self._spares)

    def _start_thread(self) -> None:
        """Start one worker (the lock held)."""
        self._live += 1
        threading.Thread(target=self._run, daemon=True,
                         name=f"formcast-grammar-{self._live}").start()

    def submit(self, fn: Callable, *args: object) -> _Job:
        job = _Job(fn, args)
        with self._lock:
            while self._live < self._wanted():
                self._start_thread()
        self._jobs.put(job)
        return job

    def abandon(self, job: _Job) -> None:
        """Let a spare thread stand in for ``job``'s worker until the job ends."""
        with self._lock:
            if job.abandoned or job.future.done():
                return
            job.abandoned = True
            self._abandoned += 1
            while self._live < self._wanted():
                self._start_thread()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                with self._lock:
                    self._live -= 1
                return
            if not job.future.set_running_or_notify_cancel():
                continue
            job.started_at = time.monotonic()
            job.started.set()
            try:
                job.future.set_result(job.fn(*job.args))
            except BaseException as exc:  # handed to the waiting caller
                job.future.set_exception(exc)
            with self._lock:
                if job.abandoned:
                    self._abandoned -= 1
                    if self._live > self._wanted():   # a spare is no longer needed
                        self._live -= 1
                        return

    def shutdown(self) -> None:
        with self._lock:
            for _ in range(self._live):
                self._jobs.put(None)


@dataclass(frozen=True, kw_only=True, eq=False)
class CompiledGrammar:
    """An immutable compiled constraint; make one matcher per request from it.

    Attributes
    ----------
    constraint : Constraint
    backend : str
        The backend that compiled it.
    vocab : Vocabulary
    coverage : SchemaCoverage or None
        For JSON Schemas: how each keyword is enforced (see :func:`explain`).
    compile_seconds : float
    warnings : tuple of str
        What compiling noticed but did not refuse: rules that can never be used, and
        the mask library's own warnings (also issued with ``warnings.warn`` when the
        grammar is compiled).
    """

    constraint: Constraint
    backend: str
    vocab: Vocabulary
    coverage: SchemaCoverage | None
    compile_seconds: float
    grammar: BackendGrammar
    # Validates the finished document when part of a JSON Schema is checked at the end.
    end_check: EndCheck | None = None
    warnings: tuple[str, ...] = ()

    @property
    def memory_bytes(self) -> int:
        return self.grammar.memory_bytes

    @property
    def vocab_size(self) -> int:
        """Width of the logits (and of the bitmask rows) this grammar is compiled for."""
        return self.vocab.vocab_size

    def matcher(self) -> Matcher:
        """A fresh matcher at the start of the constraint (cheap). Does not change self."""
        matcher = self.grammar.matcher()
        if self.end_check is not None:
            matcher = EndCheckedMatcher(matcher, self.end_check, self.vocab.token_bytes,
                                        self.vocab.eos_token_ids,
                                        ends=self.vocab.json_end_tokens)
        matcher._recipe = (self.constraint, self.backend, self.vocab)
        return matcher

    def grounded_matcher(self, text: str, plan: GroundingPlan, *,
                         distinct_items: bool = False,
                         stop_loops: bool = False) -> GroundedMatcher:
        """A fresh matcher whose grounded values come from ``text`` (see
        :func:`~formcast.grammars.grounding.ground`). Does not change self.

        Parameters
        ----------
        text : str
            The source text.
        plan : GroundingPlan
            Which values are grounded (:func:`~formcast.grammars.grounding_plan` of
            the schema compiled here).
        distinct_items : bool
            An array item equal to an earlier sibling must end its array.
        stop_loops : bool
            A plain string that repeats itself must close next.
        """
        from formcast.grammars.grounding import ground

        return ground(self.matcher(), text, plan, self.vocab, distinct_items=distinct_items,
                      stop_loops=stop_loops)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """An int32 ``[rows, ceil(vocab_size/32)]`` CPU bitmask, every token allowed."""
        return allocate_bitmask(rows, self.vocab.vocab_size)


class GrammarCompiler:
    """Compiles constraints for tokenizers, with a byte-bounded cache and a deadline.

    Compilation runs on (daemon) worker threads; a compile that misses its deadline
    raises :class:`~formcast.ConstraintError` (its result is still cached if it
    finishes).
    Failures are cached too, so a repeated bad constraint fails at lookup.

    Parameters
    ----------
    cache_bytes : int
        Budget of the compile cache (default 512 MiB).
    timeout_s : float
        Default compile deadline in seconds (default 10). It counts a compile's own
        running time, not the time it waited for a worker.
    max_workers : int
        Compile threads.
    spare_workers : int
        Threads that may stand in for workers still busy with compiles that missed
        their deadline (they cannot be stopped), so that later compiles do not wait
        for them.
    xgrammar_tuning : XGrammarTuning or None
        Passed to every xgrammar backend this compiler makes (None: its defaults).
    """

    def __init__(self, *, cache_bytes: int = DEFAULT_CACHE_BYTES,
                 timeout_s: float = DEFAULT_TIMEOUT_S, max_workers: int = 2,
                 spare_workers: int = 4, xgrammar_tuning: XGrammarTuning | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_workers < 1 or spare_workers < 0:
            raise ValueError(f"max_workers must be >= 1 and spare_workers >= 0, got "
                             f"{max_workers} and {spare_workers}")
        self.timeout_s = timeout_s
        self.xgrammar_tuning = xgrammar_tuning
        self.cache: ByteBoundedLRU[CompiledGrammar] = ByteBoundedLRU(cache_bytes)
        self._pool = _DaemonPool(max_workers, spare_workers)
        self._lock = threading.Lock()
        self._inflight: dict[tuple, _Job] = {}
        self._vocabs: OrderedDict[tuple[str, int], Vocabulary] = OrderedDict()
        self._backends: OrderedDict[tuple[str, str], Backend] = OrderedDict()

    @property
    def num_compiling(self) -> int:
        """Compiles under way (callers waiting on them, or abandoned past their deadline)."""
        return len(self._inflight)

    def vocabulary(self, tokenizer: TokenizerLike | Vocabulary, vocab_size: int | None = None
                   ) -> Vocabulary:
        """The (cached) :class:`Vocabulary` of a tokenizer for a logits width."""
        if isinstance(tokenizer, Vocabulary):
            if vocab_size is not None and vocab_size != tokenizer.vocab_size:
                raise ValueError(f"vocab_size {vocab_size} differs from the Vocabulary's "
                                 f"{tokenizer.vocab_size}")
            return tokenizer
        width = tokenizer.vocab_size if vocab_size is None else vocab_size
        if width < tokenizer.vocab_size:
            raise ValueError(f"vocab_size {width} is smaller than the tokenizer's "
                             f"{tokenizer.vocab_size} tokens")
        key = (tokenizer.fingerprint(), width)
        with self._lock:
            vocab = self._vocabs.get(key)
        if vocab is None:
            vocab = Vocabulary.from_tokenizer(tokenizer, vocab_size=width)
            with self._lock:
                self._vocabs[key] = vocab
                while len(self._vocabs) > _MAX_BACKENDS:
                    self._vocabs.popitem(last=False)
        return vocab

    def compile(self, constraint: Constraint, tokenizer: TokenizerLike | Vocabulary, *,
                backend: str = "auto", vocab_size: int | None = None,
                timeout_s: float | None = None) -> CompiledGrammar:
        """Compile ``constraint`` for ``tokenizer`` (cached). Does not change the inputs.

        Parameters
        ----------
        constraint : Regex, JsonSchema, Ebnf, Lark or Choice
        tokenizer : Tokenizer or Vocabulary
        backend : {"auto", "xgrammar", "outlines-core"}
            "auto" picks xgrammar, which compiles every constraint kind.
        vocab_size : int or None
            The model's logits width when it exceeds the tokenizer's (padding).
        timeout_s : float or None
            Deadline for this compile (default: the compiler's).

        Returns
        -------
        CompiledGrammar

        Raises
        ------
        ConstraintError
            Invalid, unsatisfiable or unsupported constraint (naming the location), or
            a compile that missed its deadline.
        ValueError
            Unknown backend or a vocab_size smaller than the tokenizer.
        """
        if not isinstance(constraint, Constraint):
            raise ConstraintError(f"not a formcast constraint: {type(constraint).__name__} "
                                  "(use Regex, JsonSchema, Ebnf, Lark, Choice or from_type)")
        name = "xgrammar" if backend == "auto" else backend
        cls = _backend_class(name)
        if not cls.supports("regex" if constraint.kind == "choice" else constraint.kind):
            raise ConstraintError(f"the {name} backend does not compile {constraint.kind} "
                                  f"constraints; use backend='xgrammar'")
        vocab = self.vocabulary(tokenizer, vocab_size)
        key = (vocab.fingerprint, name, constraint.kind, constraint.canonical_text)
        hit = self.cache.get(key)
        if isinstance(hit, Failure):
            raise ConstraintError(hit.message)
        if hit is not None:
            return hit
        arrived = time.monotonic()
        with self._lock:
            job = self._inflight.get(key)
            if job is None:
                job = self._inflight[key] = self._pool.submit(self._compile_job, key,
                                                              constraint, vocab, name)
        deadline = self.timeout_s if timeout_s is None else timeout_s
        # the deadline counts the compile's own time, not time queued behind others
        job.started.wait()
        left = deadline - (time.monotonic() - max(arrived, job.started_at))
        try:
            compiled = job.future.result(timeout=max(left, 0.0))
        except cf.TimeoutError:
            self._pool.abandon(job)
            message = (f"compiling the {constraint.kind} constraint took longer than "
                       f"{deadline:g} s; simplify it or raise the deadline")
            if self.cache.get(key) is None:
                self.cache.put(key, Failure(message), _FAILURE_BYTES)
            raise ConstraintError(message) from None
        # on the caller's thread, once per compile (a cache hit above repeats none)
        for note in compiled.warnings:
            warnings.warn(note, UserWarning, stacklevel=2)
        return compiled

    def _compile_job(self, key: tuple, constraint: Constraint, vocab: Vocabulary,
                     name: str) -> CompiledGrammar:
        """A worker's compile, cached (a constraint error too) before its caller
        hears of it: the cache (first, so that no caller finds neither) and the
        in-flight table are settled before the future is. Settled after, the
        worker's last native call (the grammar's size, through tvm-ffi, which lets
        go of the interpreter lock) could outlast a caller that returned and let
        the interpreter exit: a daemon thread that then takes the lock back is
        ended inside C++ frames, and the process aborts ("terminate called
        without an active exception")."""
        try:
            grammar = self._build(constraint, vocab, name)
        except ConstraintError as exc:
            self.cache.put(key, Failure(str(exc)), _FAILURE_BYTES)
            raise
        else:
            self.cache.put(key, grammar, max(grammar.memory_bytes, 1))
            return grammar
        finally:
            with self._lock:
                self._inflight.pop(key, None)

    def _backend(self, name: str, vocab: Vocabulary) -> Backend:
        key = (name, vocab.fingerprint)
        with self._lock:
            found = self._backends.get(key)
            if found is not None:
                self._backends.move_to_end(key)
                return found
        if name == "xgrammar":
            made = _backend_class(name)(vocab, tuning=self.xgrammar_tuning)
        else:
            made = _backend_class(name)(vocab)
        with self._lock:
            made = self._backends.setdefault(key, made)
            while len(self._backends) > _MAX_BACKENDS:
                self._backends.popitem(last=False)
        return made

    def _build(self, constraint: Constraint, vocab: Vocabulary, name: str) -> CompiledGrammar:
        start = time.perf_counter()
        # the library logs onto descriptor 2; its lines become this grammar's warnings
        with native_log().capture() as logged:
            source, coverage, end_check = grammar_source(constraint, name)
            found = () if source.kind == "json_schema" else check_grammar(source)
            grammar = self._backend(name, vocab).compile(source)
        # (a source parsed twice, checked then compiled, logs its warnings twice)
        notes = tuple(dict.fromkeys((*found, *(f"{name}: {line}" for line in logged))))
        if coverage is not None:
            coverage = replace(coverage, warnings=(*coverage.warnings, *notes))
        return CompiledGrammar(constraint=constraint, backend=name, vocab=vocab,
                               coverage=coverage, compile_seconds=time.perf_counter() - start,
                               grammar=grammar, end_check=end_check, warnings=notes)

    def close(self) -> None:
        """Let the worker threads end once the queued compiles are done."""
        self._pool.shutdown()


@cache
def default_compiler() -> GrammarCompiler:
    """The process-wide compiler :func:`compile` uses (created on first use)."""
    return GrammarCompiler()


def compile(constraint: Constraint, tokenizer: TokenizerLike | Vocabulary, *,  # noqa: A001
            backend: str = "auto", vocab_size: int | None = None,
            timeout_s: float | None = None) -> CompiledGrammar:
    """Compile a constraint into token masks for ``tokenizer``, through the default compiler.

    Parameters
    ----------
    constraint : Regex, JsonSchema, Ebnf, Lark or Choice
        What the output must conform to (see also :func:`from_type`).
    tokenizer : Tokenizer or Vocabulary
        formcast's tokenizer (``formcast.engine.load_tokenizer``) or a Vocabulary.
    backend : {"auto", "xgrammar", "outlines-core"}
        The mask library; "auto" is xgrammar (every kind). outlines-core compiles
        regex, Choice and JSON Schema.
    vocab_size : int or None
        The model's logits width if larger than the tokenizer (padded ids are never
        allowed).
    timeout_s : float or None
        Compile deadline in seconds (default 10).

    Returns
    -------
    CompiledGrammar
        Immutable; ``.matcher()`` gives a per-request matcher.

    Raises
    ------
    ConstraintError
        The constraint is invalid, unsatisfiable, unsupported (the message names the
        location: JSON pointer, regex position or grammar line:column) or too slow to
        compile. Raised before any token is generated.
    """
    return default_compiler().compile(constraint, tokenizer, backend=backend,
                                      vocab_size=vocab_size, timeout_s=timeout_s)
