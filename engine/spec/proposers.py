"""Draft proposers: grammar jump-forward and prompt lookup, behind one interface.

A proposer looks at a request (its tokens so far and its constraint) and returns
a :class:`Draft`: tokens it expects next, each with a confidence (the estimated
probability that the draft up to and including it survives verification). A
model-based drafter (an MTP head) plugs in the same way and also fills
``Draft.probs`` with its own distributions, which verification then uses.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from formcast.engine.sequence import Sequence
    from formcast.engine.spec.config import SpecConfig


@dataclass
class Draft:
    """Proposed next tokens of one request.

    Attributes
    ----------
    tokens : list[int]
    confidence : list[float]
        Per position, the estimated probability that the draft up to there survives.
    num_forced : int
        Leading tokens the grammar forces (jump-forward); confidence 1.
    probs : list[torch.Tensor] | None
        The drafter's distribution ``[V]`` at each position, for a sampling drafter;
        None when the tokens were chosen deterministically (verification then treats
        the draft distribution as a point mass on the token).
    masks : torch.Tensor | None
        ``[len + 1, words]`` int32 token bitmasks of the request's grammar at every
        position the verification pass scores (after the last token, then after
        each draft token), filled before the pass by walking a fork of the matcher
        along the draft (:func:`fill_draft_masks`); None when unconstrained.
    """

    tokens: list[int] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)
    num_forced: int = 0
    probs: list[torch.Tensor] | None = None
    masks: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def cut(self, n: int) -> "Draft":
        """The first ``n`` positions."""
        return Draft(self.tokens[:n], self.confidence[:n], min(self.num_forced, n),
                     None if self.probs is None else self.probs[:n],
                     None if self.masks is None else self.masks[:n + 1])


class Proposer(ABC):
    """Proposes up to ``max_tokens`` draft tokens for a request after ``context``."""

    @abstractmethod
    def propose(self, seq: "Sequence", context: list[int], max_tokens: int) -> Draft:
        """``context`` is the request's tokens (prompt and output), possibly extended
        by earlier proposers' tokens; nothing here changes the request."""


class JumpForwardProposer(Proposer):
    """The tokens the request's grammar forces from here (no model involved)."""

    def propose(self, seq: "Sequence", context: list[int], max_tokens: int) -> Draft:
        constraint = seq.constraint
        forced_tokens = getattr(constraint, "forced_tokens", None)
        if forced_tokens is None or max_tokens <= 0:
            return Draft()
        try:
            forced = list(forced_tokens())[:max_tokens]
        except Exception:  # a broken constraint fails later, in the sampler, on its own
            return Draft()
        return Draft(forced, [1.0] * len(forced), len(forced))


class PromptLookupProposer(Proposer):
    """Continue the longest recent n-gram that occurred earlier in the context.

    The last ``n`` tokens (``ngram_max`` down to ``ngram_min``) are searched for
    earlier in the prompt and output, most recent occurrence first; the tokens that
    followed it are the draft. Strong for extraction, where values are copied from
    the input. Confidence compounds the request's smoothed acceptance rate of
    lookup tokens, ``(accepted + 1) / (proposed + 2)``, along the draft.
    """

    def __init__(self, ngram_max: int = 4, ngram_min: int = 1, max_candidates: int = 8) -> None:
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min
        self.max_candidates = max_candidates

    def propose(self, seq: "Sequence", context: list[int], max_tokens: int) -> Draft:
        found = self.candidates(seq, context, max_tokens)
        return found[0] if found else Draft()

    def candidates(self, seq: "Sequence", context: list[int], max_tokens: int) -> list[Draft]:
        """Continuations of up to ``max_candidates`` earlier matches, best first
        (longer n-gram, then more recent); distinct continuations only. A
        constrained request takes the first its grammar allows a token of."""
        if max_tokens <= 0:
            return []
        rate = (seq.spec_lookup_accepted + 1) / (seq.spec_lookup_proposed + 2)
        out: list[Draft] = []
        seen: set[tuple[int, ...]] = set()
        for start in find_continuations(context, self.ngram_max, self.ngram_min,
                                        self.max_candidates):
            tokens = context[start:start + max_tokens]
            key = tuple(tokens)
            if tokens and key not in seen:
                seen.add(key)
                out.append(Draft(tokens, [rate ** (i + 1) for i in range(len(tokens))]))
        return out


def find_continuation(context: list[int], ngram_max: int, ngram_min: int) -> int | None:
    """Index just after the most recent earlier occurrence of the longest suffix
    n-gram of ``context`` (``ngram_max`` down to ``ngram_min``), or None."""
    found = find_continuations(context, ngram_max, ngram_min, 1)
    return found[0] if found else None


def find_continuations(context: list[int], ngram_max: int, ngram_min: int,
                       limit: int) -> list[int]:
    """Up to ``limit`` indices just after earlier occurrences of suffix n-grams of
    ``context``: longest n-gram first, most recent occurrence first within one."""
    size = len(context)
    found: list[int] = []
    for n in range(min(ngram_max, size - 1), ngram_min - 1, -1):
        suffix = context[size - n:]
        first = suffix[0]
        # scan right to left; a match must end before the suffix itself starts
        for i in range(size - n - 1, -1, -1):
            if context[i] == first and context[i:i + n] == suffix and i + n not in found:
                found.append(i + n)
                if len(found) >= limit:
                    return found
    return found


def propose(seq: "Sequence", config: "SpecConfig", max_tokens: int,
            proposers: tuple[Proposer, ...]) -> Draft:
    """The draft for one request: each proposer extends the previous ones' tokens;
    the result is cut at the first token the constraint rejects and where the
    confidence falls below ``config.min_confidence``."""
    draft = Draft()
    context = seq.token_ids
    for proposer in proposers:
        room = max_tokens - len(draft)
        if room <= 0:
            break
        many = getattr(proposer, "candidates", None)
        parts = many(seq, context + draft.tokens, room) if many is not None else \
            [proposer.propose(seq, context + draft.tokens, room)]
        part = _best_candidate(seq, draft, [p for p in parts if p.tokens])
        if part is None:
            continue
        base = draft.confidence[-1] if draft.confidence else 1.0
        forced = draft.num_forced + part.num_forced if draft.num_forced == len(draft) else \
            draft.num_forced
        draft = Draft(draft.tokens + part.tokens,
                      draft.confidence + [base * c for c in part.confidence], forced)
    # every part was cut where the constraint stops allowing it (_best_candidate)
    keep = next((i for i, c in enumerate(draft.confidence) if c < config.min_confidence),
                len(draft))
    return draft.cut(keep)


def _best_candidate(seq: "Sequence", before: Draft, parts: list[Draft]) -> Draft | None:
    """The first candidate (the best match) whose first token the request's constraint
    allows after ``before``, cut where the constraint stops allowing it."""
    if not parts:
        return None
    if seq.constraint is None:
        return parts[0]
    for part in parts:
        try:
            n = seq.constraint.valid_prefix(before.tokens + part.tokens) - len(before)
        except Exception:
            return None
        if n > 0:
            return part.cut(n)
    return None


def fill_draft_masks(constraint, tokens: list[int], words: int) -> torch.Tensor | None:
    """Bitmasks for verifying ``tokens``: row ``j`` is the grammar's mask after the
    first ``j`` draft tokens, made on a fork so the request's matcher is untouched.
    None when the constraint cannot fork (its masks are then filled in place, one
    position at a time, during verification)."""
    fork = getattr(constraint, "fork", None)
    if fork is None:
        return None
    walker = fork()
    masks = torch.zeros(len(tokens) + 1, words, dtype=torch.int32)
    for j in range(len(tokens) + 1):
        walker.fill_bitmask(masks, j)
        if j < len(tokens) and not walker.accept(tokens[j]):
            return masks[:j + 1]  # validated drafts never get here
    return masks
