"""outlines-core backend: regular languages (regex, JSON Schema via its regex) as token DFAs.

outlines-core's index drops the transitions that leave an accepting state towards a
non-accepting one (``(ab)+`` then accepts only ``ab``; a top-level number cannot go on
from ``1`` to ``1.5``). The index here is therefore built for ``R`` followed by a
sentinel character, U+10FFFF, whose bytes only the stop tokens carry: no state of
``R`` itself is accepting, so no transition is lost, and a stop token ends the text
exactly where its transition leads to an accepting state (``R`` may also match
U+10FFFF as a character, e.g. inside a JSON string: there the stop token is masked
out and refused). Tokens holding the byte 0xF4 (the lead byte of
U+100000..U+10FFFF, a private-use plane) are left out, so no text can spell the
sentinel; a model cannot write plane-16 private-use characters under this backend.
"""

from __future__ import annotations

import copy

import outlines_core
import torch
from outlines_core.json_schema import build_regex_from_schema

from formcast.grammars.errors import ConstraintError
from formcast.grammars.backends.base import Backend, BackendGrammar, GrammarSource
from formcast.grammars.matcher import Matcher, check_bitmask
from formcast.grammars.vocab import Vocabulary

SENTINEL = "\U0010ffff"
_SENTINEL_BYTES = SENTINEL.encode("utf-8")
_MAX_ROLLBACK = 1 << 20
_MAX_FORCED = 64
_OUTLINES_EXPONENT = "([eE][+-][0-9]+)?"
_JSON_EXPONENT = "([eE][+-]?[0-9]+)?"
_BYTES_PER_TRANSITION = 16


class OutlinesBackend(Backend):
    name = "outlines-core"
    kinds = frozenset({"regex", "json_schema"})

    def __init__(self, vocab: Vocabulary) -> None:
        super().__init__(vocab)
        table: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab.token_bytes):
            if b and 0xF4 not in b:
                table.setdefault(b, []).append(i)
        table[_SENTINEL_BYTES] = sorted(vocab.eos_token_ids)
        # outlines-core also wants an "eos" of its own; it is only ever allowed after the
        # sentinel (i.e. after a stop token, when this matcher is terminated), so an id
        # no mask row holds is safe.
        self.oc_vocab = outlines_core.Vocabulary(vocab.vocab_size, table)

    def compile(self, source: GrammarSource) -> OutlinesGrammar:
        if source.kind == "regex":
            regex = source.text
        elif source.kind == "json_schema":
            ws = source.max_whitespace
            pattern = f"[ \\t\\n\\r]{{0,{ws}}}" if ws else ""
            try:
                regex = build_regex_from_schema(source.text, pattern)
            except (ValueError, TypeError) as exc:
                raise ConstraintError(f"json_schema: outlines-core cannot compile it: {exc}"
                                      ) from None
            # outlines-core requires a sign in exponents (1e+5, never 1e5); JSON does not.
            regex = regex.replace(_OUTLINES_EXPONENT, _JSON_EXPONENT)
        else:
            raise ConstraintError(f"the outlines-core backend does not compile {source.kind!r}; "
                                  "use backend='xgrammar'")
        try:
            index = outlines_core.Index(f"(?:{regex})\\x{{10FFFF}}", self.oc_vocab)
        except ValueError as exc:
            raise ConstraintError(f"{source.kind}: outlines-core cannot build an index: {exc}"
                                  ) from None
        return OutlinesGrammar(index, self.vocab)


class OutlinesGrammar(BackendGrammar):
    def __init__(self, index: outlines_core.Index, vocab: Vocabulary) -> None:
        self.index = index
        self.vocab = vocab
        self.eos = vocab.eos_token_ids
        self.any_eos = min(vocab.eos_token_ids)
        self.words = vocab.bitmask_words
        # Charged per transition: the index is a map state -> token -> state.
        transitions = index.get_transitions()
        self._size = 1024 + _BYTES_PER_TRANSITION * sum(len(t) for t in transitions.values())
        # R may itself match U+10FFFF (a JSON string, a negated class), so a stop token can
        # have a transition where R is not complete; only one into an accepting state ends R.
        finals = set(index.get_final_states())
        self.completing = frozenset(s for s, t in transitions.items()
                                    if t.get(self.any_eos) in finals)
        self.eos_not_final = frozenset(s for s, t in transitions.items()
                                       if self.any_eos in t and t[self.any_eos] not in finals)

    @property
    def memory_bytes(self) -> int:
        return self._size

    def matcher(self) -> OutlinesMatcher:
        return OutlinesMatcher(self, outlines_core.Guide(self.index, max_rollback=_MAX_ROLLBACK),
                               [], None)


class OutlinesMatcher(Matcher):
    __slots__ = ("_g", "_guide", "_steps", "_eos_step", "_recipe")

    def __init__(self, grammar: OutlinesGrammar, guide: outlines_core.Guide,
                 steps: list[int], eos_step: int | None) -> None:
        self._g = grammar
        self._guide = guide
        self._steps = steps            # tokens taken by each step
        self._eos_step = eos_step      # the step that accepted a stop token

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = self._g.words
        shape = bitmask.shape
        # A raw pointer write follows: check the buffer (cheap attribute reads only).
        if (bitmask.dtype is not torch.int32 or not bitmask.is_cpu or len(shape) != 2
                or shape[1] != words or not bitmask.is_contiguous() or not 0 <= row < shape[0]):
            check_bitmask(bitmask, row, self._g.vocab.vocab_size)   # raises, saying why
        if self._eos_step is not None:
            bitmask[row].zero_()
            return
        self._guide.write_mask_into(bitmask.data_ptr() + row * words * 4, words, 4)
        if self._guide.get_state() in self._g.eos_not_final:
            for eos in self._g.eos:
                word = eos >> 5
                value = int(bitmask[row, word]) & ~(1 << (eos & 31)) & 0xFFFFFFFF
                bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value

    def _is_fresh(self) -> bool:
        return not self._steps

    def accept(self, token_id: int) -> bool:
        if self._eos_step is not None:
            return False
        if token_id in self._g.eos and self._guide.get_state() not in self._g.completing:
            return False
        try:
            self._guide.advance(token_id, return_tokens=False)
        except (ValueError, OverflowError):     # no transition; an id outside u32
            return False
        if token_id in self._g.eos:
            self._eos_step = len(self._steps)
        self._steps.append(1)
        return True

    def accept_text(self, text: str) -> bool:
        if self._eos_step is not None:
            return False
        ids = self._g.vocab.segment(text.encode("utf-8"))
        if ids is None:
            return False
        for n, token_id in enumerate(ids):
            try:
                self._guide.advance(token_id, return_tokens=False)
            except ValueError:
                if n:
                    self._guide.rollback_state(n)
                return False
        self._steps.append(len(ids))
        return True

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= len(self._steps):
            raise ValueError(f"cannot roll back {num_tokens} steps; {len(self._steps)} taken")
        if not num_tokens:
            return
        tokens = sum(self._steps[-num_tokens:])
        if tokens:
            self._guide.rollback_state(tokens)
        del self._steps[-num_tokens:]
        if self._eos_step is not None and self._eos_step >= len(self._steps):
            self._eos_step = None
        self._restart_spans()

    def is_terminated(self) -> bool:
        return self._eos_step is not None

    def is_completed(self) -> bool:
        return self._eos_step is None and self._guide.get_state() in self._g.completing

    def forced_tokens(self) -> list[int]:
        if self._eos_step is not None:
            return []
        guide = copy.copy(self._guide)
        forced: list[int] = []
        while len(forced) < _MAX_FORCED:
            allowed = guide.get_tokens()
            if len(allowed) != 1 or allowed[0] in self._g.eos:
                break
            forced.append(allowed[0])
            guide.advance(allowed[0], return_tokens=False)
        return forced

    def fork(self) -> OutlinesMatcher:
        return OutlinesMatcher(self._g, copy.copy(self._guide), list(self._steps),
                               self._eos_step)
