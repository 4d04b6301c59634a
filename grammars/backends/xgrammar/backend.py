"""The xgrammar backend: compiling regex, JSON Schema, EBNF and Lark grammars."""

from __future__ import annotations

import ctypes
import threading

import numpy
import torch
import xgrammar as xgr

from formcast.grammars.backends.base import Backend, BackendGrammar, GrammarSource
from formcast.grammars.backends.xgrammar.ffi import library_message
from formcast.grammars.backends.xgrammar.fill_plan import FillPlans
from formcast.grammars.backends.xgrammar.matcher import XGrammarMatcher
from formcast.grammars.backends.xgrammar.text_masks import TextMasks
from formcast.grammars.backends.xgrammar.tuning import XGrammarTuning
from formcast.grammars.errors import ConstraintError
from formcast.grammars.vocab import Vocabulary


class XGrammarBackend(Backend):
    """The default backend, bound to one vocabulary.

    Parameters
    ----------
    vocab : Vocabulary
    tuning : XGrammarTuning or None
        Its performance knobs (None: the defaults); read by every grammar and
        matcher it makes.
    """

    name = "xgrammar"
    kinds = frozenset({"regex", "json_schema", "ebnf", "lark"})

    def __init__(self, vocab: Vocabulary, *, tuning: XGrammarTuning | None = None) -> None:
        super().__init__(vocab)
        self.tuning = XGrammarTuning() if tuning is None else tuning
        self.tokenizer_info = xgr.TokenizerInfo(
            list(vocab.token_bytes), xgr.VocabType.RAW, vocab_size=vocab.vocab_size,
            stop_token_ids=sorted(vocab.eos_token_ids), add_prefix_space=False)
        # formcast's compile cache is the one cache; xgrammar's own would double-count.
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info,
                                            max_threads=self.tuning.compile_thread_count,
                                            cache_enabled=False)
        # Non-stop special tokens (and padding) are never allowed; checking them here
        # keeps xgrammar from logging a warning for each such accept.
        self.blocked = frozenset(vocab.special_token_ids - vocab.eos_token_ids)
        self.stops = frozenset(vocab.eos_token_ids)
        self.special_ids = self.blocked | self.stops
        self.fill_plans = FillPlans(self.tuning)
        self._special: ctypes.Array | None = None
        self._view: tuple[torch.Tensor, numpy.ndarray | None] | None = None

    def numpy_view(self, bitmask: torch.Tensor) -> tuple[torch.Tensor, numpy.ndarray | None]:
        """``(bitmask, its numpy view)`` (None for a mask outside host memory).
        The last one is kept: the matchers of a run fill one bitmask, and
        torch's view costs more than a fill of a known mask."""
        view = self._view
        if view is None or view[0] is not bitmask:
            view = self._view = (bitmask, bitmask.numpy() if bitmask.device.type == "cpu"
                                 else None)
        return view

    def compile(self, source: GrammarSource) -> XGrammarGrammar:
        try:
            if source.kind == "regex":
                compiled = self.compiler.compile_regex(source.text)
            elif source.kind == "json_schema":
                ws = source.max_whitespace
                compiled = self.compiler.compile_json_schema(
                    source.text, any_whitespace=ws > 0, separators=(",", ":"),
                    max_whitespace_cnt=ws if ws > 0 else None, strict_mode=True)
            elif source.kind == "ebnf":
                grammar = xgr.Grammar.from_ebnf(source.text, root_rule_name=source.root)
                compiled = self.compiler.compile_grammar(grammar)
            elif source.kind == "lark":
                compiled = self.compiler.compile_grammar(xgr.Grammar.from_lark(source.text))
            else:
                raise ConstraintError(f"xgrammar backend cannot compile {source.kind!r}")
        except RuntimeError as exc:
            raise ConstraintError(f"{source.kind}: {library_message(exc)}") from None
        return XGrammarGrammar(compiled, self)

    def special_bits(self) -> ctypes.Array:
        """The tokens the native worker must not offer (blocked, stop tokens), a
        bitmap over the tokenizer's ids; made once."""
        if self._special is None:
            size = self.vocab.tokenizer_size
            bits = bytearray((size + 7) // 8)
            for t in self.blocked | self.stops:
                if 0 <= t < size:
                    bits[t >> 3] |= 1 << (t & 7)
            self._special = (ctypes.c_uint8 * len(bits)).from_buffer(bits)
        return self._special


class XGrammarGrammar(BackendGrammar):
    """One compiled xgrammar grammar, and what its matchers learn and share:
    the known masks of short texts, the answers by text of the engine's hooks,
    the tokens it fixes at its start."""

    def __init__(self, compiled: xgr.CompiledGrammar, backend: XGrammarBackend) -> None:
        self.compiled = compiled
        self.backend = backend
        # a matcher at the grammar's start that never moves: new matchers are its
        # forks (a copy of its state, cheaper than xgrammar's constructor)
        self._start: xgr.GrammarMatcher | None = None
        self.fork_lock = threading.Lock()  # (forks of its matchers, on two threads at once)
        # kept text -> whether the grammar fixes the next text there (see
        # XGrammarMatcher.forces_text): held by the grammar, so it goes with it
        self.forced_texts: dict[bytes, bool] = {}
        # kept text -> whether the grammar allows few tokens there (see
        # XGrammarMatcher.narrow_choice)
        self.narrow_texts: dict[bytes, bool] = {}
        # kept text -> the mask of the state it leads to
        self.text_masks = TextMasks((backend.tokenizer_info.vocab_size + 31) // 32,
                                    backend.tuning.text_mask_rows)
        # the tokens the grammar fixes at its start, a matcher that took them
        # (forks of it are new matchers that took them too) and their text
        self._opening: tuple[tuple[int, ...], xgr.GrammarMatcher, bytes] | None = None

    @property
    def memory_bytes(self) -> int:
        return int(self.compiled.memory_size_bytes) + self.text_masks.memory_bytes

    def opening(self) -> tuple[tuple[int, ...], xgr.GrammarMatcher, bytes]:
        """The tokens the grammar fixes at its start (xgrammar's jump-forward
        tokens there), a matcher that took them, and their text; found once."""
        got = self._opening
        if got is None:
            with self.fork_lock:
                m = self._start.fork()
            taken: list[int] = []
            for token in m.find_jump_forward_tokens():
                if not m.accept_token(token):
                    break
                taken.append(token)
            data = self.backend.vocab.token_bytes
            got = self._opening = (tuple(taken), m, b"".join(data[t] for t in taken))
        return got

    def matcher(self) -> XGrammarMatcher:
        start = self._start
        if start is None:
            start = self._start = xgr.GrammarMatcher(self.compiled)
        backend = self.backend
        return XGrammarMatcher(None, backend.blocked, backend.vocab.tokenizer_size,
                               backend.stops, token_bytes=backend.vocab.token_bytes, origin=self)
