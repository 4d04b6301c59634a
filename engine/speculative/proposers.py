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
from typing import TYPE_CHECKING, Callable

import torch

from formcast.engine.constraint import ops_for

if TYPE_CHECKING:
    from formcast.engine.sequence import Sequence
    from formcast.engine.speculative.config import SpecConfig


@dataclass
class Draft:
    """Proposed next tokens of one request.

    Attributes
    ----------
    tokens : list[int]
    confidence : list[float]
        Per position, the estimated probability that the draft up to there survives.
    sources : list[str]
        Per position, what proposed it: ``"forced"`` (grammar jump-forward),
        ``"lookup"`` (prompt lookup), ``"closer"`` (the token the model ends a copied
        span with, from :class:`DraftMemory`), or a drafter's own name. Positions
        beyond the list count as ``"draft"``.
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
    sources: list[str] = field(default_factory=list)
    probs: list[torch.Tensor] | None = None
    masks: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def source(self, j: int) -> str:
        return self.sources[j] if j < len(self.sources) else "draft"

    @property
    def num_forced(self) -> int:
        """Positions the grammar forced (jump-forward)."""
        return self.sources.count("forced")

    def cut(self, n: int) -> "Draft":
        """The first ``n`` positions."""
        return Draft(self.tokens[:n], self.confidence[:n], self.sources[:n],
                     None if self.probs is None else self.probs[:n],
                     None if self.masks is None else self.masks[:n + 1])


class Proposer(ABC):
    """Proposes up to ``max_tokens`` draft tokens for a request after ``context``."""

    @abstractmethod
    def propose(self, seq: "Sequence", context: list[int], max_tokens: int) -> Draft:
        """``context`` is the request's tokens (prompt and output), possibly extended
        by earlier proposers' tokens; nothing here changes the request."""


class DraftMemory:
    """What verification has taught about the model's own choices, to shape drafts.

    One per engine (these are habits of the model and its tokenizer, not of one
    request), fed by :meth:`observe` after every verification.

    - **Segmentations.** Jump-forward proposes the grammar's tokenization of a
      forced string, e.g. ``":"`` as one token, where the model writes ``":`` and
      then ``"``, and so rejects it every time. When a forced token is rejected for
      a token whose text is a proper prefix of it, that token is proposed instead
      from then on (the grammar forces the rest after it).
    - **Closers.** A value copied from the text ends where the text goes on with a
      delimiter (``,`` ``.``): the model writes a token that closes the value
      (``",``) where prompt lookup proposed the delimiter. When a lookup token is
      rejected for a token after which the grammar forces tokens again, the pair is
      counted; a lookup continuation that meets such a delimiter then proposes the
      closer in its place (followed by the forced tokens), with the pair's observed
      rate as its confidence.
    """

    def __init__(self, token_bytes: list[bytes]) -> None:
        self._bytes = token_bytes
        self.segmentations: dict[int, int] = {}
        self._closed: dict[int, dict[int, int]] = {}   # delimiter -> closer -> times
        self._copied: dict[int, int] = {}              # delimiter -> times copied past

    def observe(self, seq: "Sequence", draft: Draft, accepted: int, token: int | None) -> None:
        """Verification of ``draft`` accepted its first ``accepted`` positions, then
        the model chose ``token`` (None: no position was rejected). Call after the
        request's matcher took the accepted tokens and ``token``."""
        for j in range(accepted):
            if draft.source(j) == "lookup":
                t = draft.tokens[j]
                if t in self._closed:
                    self._copied[t] = self._copied.get(t, 0) + 1
        if token is None or accepted >= len(draft):
            return
        proposed, kind = draft.tokens[accepted], draft.source(accepted)
        if kind == "forced":
            mine, theirs = self.text(token), self.text(proposed)
            if mine and len(mine) < len(theirs) and theirs.startswith(mine):
                self.segmentations[proposed] = token
        elif kind == "closer":
            # the model did not close here; where it went on with a known delimiter
            # instead (a copy past it), that counts against the closer
            if token in self._closed:
                self._copied[token] = self._copied.get(token, 0) + 1
        elif kind == "lookup" and self._delimiter(proposed) and _forces_next(seq.constraint):
            counts = self._closed.setdefault(proposed, {})
            counts[token] = counts.get(token, 0) + 1

    def _delimiter(self, token: int) -> bool:
        """Whether ``token`` can end a copied value: it starts with neither a letter nor
        a digit (``,`` ``.`` ``;`` a space), so the value cannot go on into it."""
        text = self.text(token).decode("utf-8", "ignore")
        return bool(text) and not text[0].isalnum()

    def closer(self, delimiter: int) -> tuple[int, float] | None:
        """The token the model closes a copied value with where the text has
        ``delimiter``, and how often it did so (smoothed); None if never seen."""
        counts = self._closed.get(delimiter)
        if not counts:
            return None
        token, times = max(counts.items(), key=lambda kv: kv[1])
        total = sum(counts.values()) + self._copied.get(delimiter, 0)
        return token, (times + 1) / (total + 2)

    def text(self, token: int) -> bytes:
        """The bytes of ``token`` (empty for an id outside the vocabulary)."""
        return self._bytes[token] if 0 <= token < len(self._bytes) else b""


def _forces_next(constraint) -> bool:
    try:
        return constraint is not None and bool(constraint.forced_tokens())
    except Exception:
        return False


class JumpForwardProposer(Proposer):
    """The tokens the request's grammar forces after ``context`` (no model involved),
    segmented the way the model writes them where :class:`DraftMemory` knows."""

    def __init__(self, memory: DraftMemory | None = None) -> None:
        self.memory = memory

    def propose(self, seq: "Sequence", context: list[int], max_tokens: int) -> Draft:
        constraint = seq.constraint
        if constraint is None or max_tokens <= 0:
            return Draft()
        ahead = context[len(seq.token_ids):]  # earlier proposers' tokens
        tokens: list[int] = []
        try:
            if ahead and constraint.valid_prefix(ahead) < len(ahead):
                return Draft()
            while len(tokens) < max_tokens:
                forced = _forced_after(constraint, ahead + tokens)
                if not forced:
                    break
                segment = self.memory.segmentations if self.memory is not None else {}
                for i, t in enumerate(forced):
                    if t in segment:  # the model's own, shorter first piece of it
                        tokens += forced[:i] + [segment[t]]
                        break
                else:
                    tokens += forced
                    break
        except Exception:  # a broken constraint fails later, in the sampler, on its own
            return Draft()
        tokens = tokens[:max_tokens]
        return Draft(tokens, [1.0] * len(tokens), ["forced"] * len(tokens))


def _forced_after(constraint, tokens: list[int]) -> list[int]:
    """The constraint's forced tokens after accepting ``tokens`` (state unchanged;
    ``tokens`` must be allowed)."""
    taken = 0
    try:
        for t in tokens:
            if not constraint.accept(t):
                return []
            taken += 1
        return [] if constraint.is_terminated() else list(constraint.forced_tokens())
    finally:
        if taken:
            constraint.rollback(taken)




class PromptLookupProposer(Proposer):
    """Continue the longest recent n-gram that occurred earlier in the context.

    The last ``n`` tokens (``ngram_max`` down to ``ngram_min``) are searched for
    earlier in the prompt and output, most recent occurrence first; the tokens that
    followed it are the draft. Strong for extraction, where values are copied from
    the input. Confidence compounds the request's smoothed acceptance rate of
    lookup tokens, ``(accepted + 1) / (proposed + 2)``, along the draft.
    """

    def __init__(self, ngram_max: int = 4, ngram_min: int = 1, max_candidates: int = 8,
                 memory: DraftMemory | None = None,
                 encode: Callable[[str], list[int]] | None = None, *,
                 text_window: int = 1024, text_tries: int = 4, text_bytes: int = 64) -> None:
        # text_window: tokens of context searched by text; text_tries: text matches
        # tried per tail; text_bytes: bytes of continuation tokenized per match
        # (EngineTuning.lookup_text_*)
        self.text_window, self.text_tries, self.text_bytes = text_window, text_tries, text_bytes
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min
        self.max_candidates = max_candidates
        self.memory = memory
        self.encode = encode

    def propose(self, seq: "Sequence", context: list[int], max_tokens: int) -> Draft:
        found = self.candidates(seq, context, max_tokens)
        return found[0] if found else Draft()

    def candidates(self, seq: "Sequence", context: list[int], max_tokens: int) -> list[Draft]:
        """Continuations of up to ``max_candidates`` earlier matches, best first;
        distinct continuations only. A constrained request takes the first its
        grammar allows a token of.

        Order: token n-grams of two or more tokens (longer, then more recent), then
        text matches (:meth:`text_continuations`, where ``encode`` and ``memory`` are
        given), then single-token matches.
        """
        if max_tokens <= 0:
            return []
        rate = (seq.spec_lookup_accepted + 1) / (seq.spec_lookup_proposed + 2)
        long, short = [], []
        for start, n in find_continuations(context, self.ngram_max, self.ngram_min,
                                           self.max_candidates, with_length=True):
            (long if n >= 2 else short).append(context[start:start + max_tokens])
        ordered = long + self.text_continuations(context, max_tokens) + short
        out: list[Draft] = []
        seen: set[tuple[int, ...]] = set()
        for tokens in ordered:
            key = tuple(tokens)
            if tokens and key not in seen:
                seen.add(key)
                out.append(self._with_closer(tokens, rate, seq.constraint is not None))
        return out

    def text_continuations(self, context: list[int], max_tokens: int) -> list[list[int]]:
        """Continuations found by text, not by token: the text of the last one or two
        tokens is searched for in the text before them (most recent first), and the
        text that follows it there is tokenized afresh.

        This finds what token n-grams miss where the output spells a copied word
        differently from the prompt: ``"The`` against the prompt's `` The``, or a
        value started with ``P`` where the prompt has `` Pixel``. A match counts only
        where tokenizing the matched text plus its continuation starts with the very
        tokens the output has (``P`` + ``ixel`` backs the output's ``P``; ``Print``
        does not); its continuation is the rest, up to the end of the line.
        """
        if self.encode is None or self.memory is None or len(context) < 2:
            return []
        spell = self.memory.text
        found: list[list[int]] = []
        for k in (2, 1):
            tail = context[-k:]
            needle = b"".join(spell(t) for t in tail)
            if not any(c.isalnum() for c in needle.decode("utf-8", "ignore")):
                continue  # punctuation alone matches anywhere
            hay = b"".join(spell(t) for t in context[-k - self.text_window:-k])
            end, tries = len(hay), 0
            while tries < self.text_tries:
                at = hay.rfind(needle, 0, end)
                if at < 0:
                    break
                end, tries = at + len(needle) - 1, tries + 1
                rest = hay[at + len(needle):at + len(needle) + self.text_bytes]
                line = rest.split(b"\n", 1)
                whole = len(line) > 1 or at + len(needle) + self.text_bytes >= len(hay)
                text = (needle + line[0]).decode("utf-8", "ignore")
                ids = self.encode(text)
                if ids[:k] != tail:
                    continue
                # a continuation cut mid-word may end in a token the full word lacks
                ids = ids[k:] if whole else ids[k:-1]
                if ids:
                    found.append(ids[:max_tokens])
        return found

    def _with_closer(self, tokens: list[int], rate: float, constrained: bool) -> Draft:
        """The continuation as a draft; for a constrained request, cut at the first
        delimiter the model is known to close a copied value at, with the closer in
        its place."""
        confidence = [rate ** (i + 1) for i in range(len(tokens))]
        sources = ["lookup"] * len(tokens)
        if constrained and self.memory is not None:
            for i, t in enumerate(tokens):
                found = self.memory.closer(t)
                if found is not None and found[1] >= 0.5:
                    base = confidence[i - 1] if i else 1.0
                    return Draft(tokens[:i] + [found[0]], confidence[:i] + [base * found[1]],
                                 sources[:i] + ["closer"])
        return Draft(tokens, confidence, sources)


def find_continuation(context: list[int], ngram_max: int, ngram_min: int) -> int | None:
    """Index just after the most recent earlier occurrence of the longest suffix
    n-gram of ``context`` (``ngram_max`` down to ``ngram_min``), or None."""
    found = find_continuations(context, ngram_max, ngram_min, 1)
    return found[0] if found else None


def find_continuations(context: list[int], ngram_max: int, ngram_min: int,
                       limit: int, *, with_length: bool = False) -> list:
    """Up to ``limit`` indices just after earlier occurrences of suffix n-grams of
    ``context``: longest n-gram first, most recent occurrence first within one.
    ``with_length``: ``(index, n)`` pairs instead."""
    size = len(context)
    found: list[int] = []
    lengths: list[int] = []
    for n in range(min(ngram_max, size - 1), ngram_min - 1, -1):
        suffix = context[size - n:]
        first = suffix[0]
        # scan right to left; a match must end before the suffix itself starts
        for i in range(size - n - 1, -1, -1):
            if context[i] == first and context[i:i + n] == suffix and i + n not in found:
                found.append(i + n)
                lengths.append(n)
                if len(found) >= limit:
                    return list(zip(found, lengths)) if with_length else found
    return list(zip(found, lengths)) if with_length else found


def propose(seq: "Sequence", config: "SpecConfig", max_tokens: int,
            proposers: tuple[Proposer, ...], *, rounds: int = 3) -> Draft:
    """The draft for one request: each proposer extends the previous ones' tokens,
    in turn, for up to ``rounds`` passes while the draft grows (forced key, copied
    value and its closer, the next forced key, ...); the result is cut at the first
    token the constraint rejects and where the confidence falls below
    ``config.min_confidence``."""
    draft = Draft()
    context = seq.token_ids
    for _ in range(rounds):
        size = len(draft)
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
            sources = part.sources + ["draft"] * (len(part) - len(part.sources))
            draft = Draft(draft.tokens + part.tokens,
                          draft.confidence + [base * c for c in part.confidence],
                          draft.sources + sources)
            if part.source(len(part) - 1) == "lookup":
                break  # a copy runs on to max_tokens or a rejected token: nothing follows
        if len(draft) == size or len(draft) >= max_tokens:
            break
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
    first ``j`` draft tokens, made on a fork so the request's matcher is untouched
    (empty after a draft token that terminates the constraint).
    None when the constraint cannot fork (its masks are then filled in place, one
    position at a time, during verification)."""
    walker = ops_for(type(constraint)).fork(constraint)
    if walker is None:
        return None
    masks = torch.zeros(len(tokens) + 1, words, dtype=torch.int32)
    for j in range(len(tokens) + 1):
        if walker.is_terminated():  # the draft ended the constraint (its stop token):
            return masks[:j + 1]    # nothing may follow, row j stays empty
        walker.fill_bitmask(masks, j)
        if j < len(tokens) and not walker.accept(tokens[j]):
            return masks[:j + 1]  # validated drafts never get here
    return masks
