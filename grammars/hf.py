"""Any formcast constraint applied to transformers' ``model.generate``.

For people who keep their own transformers model::

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from formcast.grammars import JsonSchema
    from formcast.grammars.hf import ConstraintLogitsProcessor

    processor = ConstraintLogitsProcessor(JsonSchema(schema), tokenizer,
                                          vocab_size=model.config.vocab_size)
    out = model.generate(**inputs, logits_processor=[processor], max_new_tokens=256)

What is supported: greedy and sampled decoding of a batch (one matcher per row of
``input_ids``), ``num_return_sequences``, left-padded prompts, logits wider than the
tokenizer (the extra columns are never allowed), and beam search (rows that
transformers reorders between steps are followed by their text: a row continues the
state of the row whose tokens it carries). Stop tokens are allowed only where the
constraint is complete; a row that ended is left to transformers, which pads it.

What is not: decoding that feeds the processor several new tokens a step and may
take some back (assisted / speculative generation): a row whose tokens match no
row of the previous step raises ``RuntimeError``. A JSON Schema keyword checked
when the value ends (``uniqueItems`` and the like, see
:func:`~formcast.grammars.explain`) can meet a dead end that formcast's own engine
undoes by rolling back; here the row is allowed only to stop, and its row index is
listed in :attr:`ConstraintLogitsProcessor.dead_ends`.

One processor follows one ``generate`` call; a call with a new batch (another
size, or shorter rows) starts it afresh, and :meth:`~ConstraintLogitsProcessor.reset`
does so explicitly.

transformers is needed only here (``pip install transformers``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

try:
    from transformers import LogitsProcessor
except ImportError as exc:  # a test dependency of formcast, not a runtime one
    raise ImportError("formcast.grammars.hf needs transformers (pip install transformers); "
                      "the rest of formcast.grammars works without it") from exc

from formcast.engine.tokenizer import Tokenizer
from formcast.grammars.bitmask import allocate_bitmask, fill_bitmasks
from formcast.grammars.compiler import CompiledGrammar, GrammarCompiler, default_compiler
from formcast.grammars.constraints import Constraint
from formcast.grammars.matcher import Matcher


def formcast_tokenizer(tokenizer: object, *, eos_token_id: int | Iterable[int] | None = None
                       ) -> Tokenizer:
    """formcast's :class:`~formcast.engine.Tokenizer` over a transformers fast tokenizer.

    Shares the tokenizer's Rust backend (nothing is copied or changed).

    Parameters
    ----------
    tokenizer : transformers.PreTrainedTokenizerFast
    eos_token_id : int, iterable of int or None
        The ids that end generation (pass ``model.generation_config.eos_token_id``
        when it differs from the tokenizer's); default the tokenizer's eos token.

    Returns
    -------
    Tokenizer

    Raises
    ------
    TypeError
        A slow (Python) tokenizer: formcast reads the fast tokenizer's vocabulary.
    ValueError
        No eos token is known.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"{type(tokenizer).__name__} is not a fast tokenizer; load it with "
                        "AutoTokenizer.from_pretrained(..., use_fast=True)")
    if eos_token_id is None:
        eos_token_id = getattr(tokenizer, "eos_token_id", None)
    eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or ())
    if not eos:
        raise ValueError("the tokenizer names no eos token; pass eos_token_id=")
    # no chat template: the stop ids are exactly the ones given
    return Tokenizer(backend, bos_token_id=getattr(tokenizer, "bos_token_id", None),
                     eos_token_id=eos[0], extra_eos_token_ids=eos[1:],
                     pad_token_id=getattr(tokenizer, "pad_token_id", None))


@dataclass
class _Batch:
    """The matchers of one ``generate`` call: row ``i`` has taken ``taken[i]``."""

    prompt_len: int
    seen_len: int
    matchers: list[Matcher]
    taken: list[tuple[int, ...]]
    ended: list[bool]


class ConstraintLogitsProcessor(LogitsProcessor):
    """A transformers ``LogitsProcessor`` that keeps every row inside a constraint.

    Parameters
    ----------
    constraint : Constraint
        Any formcast constraint: JsonSchema, Regex, Ebnf, Lark, Choice or
        ``from_type(...)``.
    tokenizer : transformers.PreTrainedTokenizerFast
        The model's tokenizer.
    vocab_size : int or None
        The model's logits width (``model.config.vocab_size``) when it exceeds the
        tokenizer's; columns past the tokenizer are never allowed. Default: the
        tokenizer's size (a wider width met at the first step compiles again).
    eos_token_id : int, iterable of int or None
        The ids that end generation; default the tokenizer's eos token.
    compiler : GrammarCompiler or None
        Default: formcast's process-wide compiler (and its cache).
    timeout_s : float or None
        Compile deadline.

    Attributes
    ----------
    compiled : CompiledGrammar
        The constraint compiled for the tokenizer (``compiled.warnings`` lists what
        compiling noticed).
    dead_ends : set of int
        Rows of the current batch that met a state where the constraint allows no
        token (an end check failing): they were allowed only to stop.

    Raises
    ------
    ConstraintError
        The constraint is invalid or unsatisfiable (raised here, before generation).
    """

    def __init__(self, constraint: Constraint, tokenizer: object, *,
                 vocab_size: int | None = None, eos_token_id: int | Iterable[int] | None = None,
                 compiler: GrammarCompiler | None = None, timeout_s: float | None = None
                 ) -> None:
        self.constraint = constraint
        self.tokenizer = formcast_tokenizer(tokenizer, eos_token_id=eos_token_id)
        self._compiler = compiler if compiler is not None else default_compiler()
        self._timeout_s = timeout_s
        self.compiled = self._compile(vocab_size)
        self._eos = frozenset(self.compiled.vocab.eos_token_ids)
        self._batch: _Batch | None = None
        self.dead_ends: set[int] = set()

    def _compile(self, vocab_size: int | None) -> CompiledGrammar:
        return self._compiler.compile(self.constraint, self.tokenizer, vocab_size=vocab_size,
                                      timeout_s=self._timeout_s)

    def reset(self) -> None:
        """Forget the current batch: the next call starts a new ``generate``."""
        self._batch = None
        self.dead_ends = set()

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor
                 ) -> torch.FloatTensor:
        """Mask ``scores`` in place to the tokens each row's constraint allows.

        Parameters
        ----------
        input_ids : torch.LongTensor
            ``[rows, length]``: prompts (left-padded) and the tokens generated so far.
        scores : torch.FloatTensor
            ``[rows, vocab]`` logits of the next token.

        Returns
        -------
        torch.FloatTensor
            ``scores``, with disallowed tokens at ``-inf``.
        """
        rows, length = input_ids.shape
        width = scores.shape[-1]
        if width < self.compiled.vocab.tokenizer_size:
            raise ValueError(f"the logits have {width} columns, fewer than the tokenizer's "
                             f"{self.compiled.vocab.tokenizer_size} tokens")
        if width != self.compiled.vocab_size:
            self.compiled = self._compile(width)
        batch = self._batch
        if batch is None or len(batch.matchers) != rows or length <= batch.seen_len:
            self.dead_ends = set()
            batch = self._batch = _Batch(prompt_len=length, seen_len=length,
                                         matchers=[self.compiled.matcher() for _ in range(rows)],
                                         taken=[()] * rows, ended=[False] * rows)
        else:
            self._follow(batch, input_ids[:, batch.prompt_len:].tolist())
            batch.seen_len = length
        bitmask = allocate_bitmask(rows, width)
        live = [r for r in range(rows) if not batch.ended[r]]
        fill_bitmasks([batch.matchers[r] for r in live], bitmask, live)
        for r in range(rows):
            if batch.ended[r] or not bool(bitmask[r].any()):
                if not batch.ended[r]:
                    self.dead_ends.add(r)
                _only(bitmask, r, sorted(self._eos))
        _apply(scores, bitmask)
        return scores

    def _follow(self, batch: _Batch, generated: list[list[int]]) -> None:
        """Bring each row's matcher up to its tokens: the row's own matcher, or a
        fork of the matcher of the row whose tokens it continues (beam search moves
        rows between steps)."""
        by_tokens = {taken: r for r, taken in enumerate(batch.taken)}
        matchers, ended = [], []
        used: set[int] = set()
        done = len(batch.taken[0]) if batch.taken else 0     # every row is as long
        for r, tokens in enumerate(generated):
            before = tuple(tokens[:done])
            source = r if before == batch.taken[r] else by_tokens.get(before)
            if source is None:
                raise RuntimeError(
                    f"row {r}'s tokens continue no row of the previous step; "
                    "ConstraintLogitsProcessor follows greedy, sampled and beam decoding, "
                    "not decoding that takes tokens back (assisted generation)")
            matcher = batch.matchers[source]
            matchers.append(matcher.fork() if source in used else matcher)
            used.add(source)
            ended.append(batch.ended[source])
        for r, tokens in enumerate(generated):
            for token in tokens[done:]:
                ended[r] = ended[r] or self._take(matchers[r], token, r)
        batch.matchers, batch.ended = matchers, ended
        batch.taken = [tuple(t) for t in generated]

    def _take(self, matcher: Matcher, token: int, row: int) -> bool:
        """Advance ``matcher`` by ``token``; whether the row has ended."""
        if token in self._eos or row in self.dead_ends:
            return True
        if not matcher.accept(token):
            raise RuntimeError(f"row {row} took token {token}, which its constraint does "
                               "not allow there (another processor changed the scores "
                               "after this one?)")
        return False


def _only(bitmask: torch.Tensor, row: int, tokens: Sequence[int]) -> None:
    """Allow exactly ``tokens`` in ``bitmask[row]``."""
    bitmask[row].zero_()
    for token in tokens:
        word, bit = token >> 5, token & 31
        value = (int(bitmask[row, word]) | (1 << bit)) & 0xFFFFFFFF
        bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


__all__ = ["ConstraintLogitsProcessor", "formcast_tokenizer"]


def _apply(scores: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the disallowed tokens' scores to -inf, in place, on the scores' device.

    ``scores`` is ``[B, V]``, ``bitmask`` int32 ``[B, ceil(V'/32)]`` with ``V' >= V``;
    a plain torch unpacking: the grammar layer uses no engine kernel.
    """
    shifts = torch.arange(32, dtype=torch.int32, device=scores.device)
    words = bitmask.to(scores.device, non_blocking=True)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)    # [B, 32 * W]
    scores.masked_fill_(~allowed[:, :scores.shape[-1]], float("-inf"))
