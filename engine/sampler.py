"""From logits to tokens: constraint masks, temperature/top-k/top-p/min-p, seeded draws.

Each row is sampled with its request's own generator and depends on nothing else
in the batch, so the same seed gives the same tokens whatever the batch holds.
Random draws use the exponential race (argmax of p / Exp(1)), which samples
exactly from p with a single draw per vocabulary entry. On CUDA the drawn rows of
a batch go through one Triton kernel (:mod:`formcast.engine.kernels.sampling`),
its noise keyed by the request's seed and the position sampled; so do CPU rows
in batch-invariant mode (``invariant``), whose speculative verification then
keeps a draft token exactly when it is the token plain sampling would draw at
its position: the same tokens with and without drafts.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from formcast.engine.constraint import bitmask_words, ops_for
from formcast.engine.kernels import current_stream, to_device, triton_available, wait_event
from formcast.engine.kernels.bitmask import apply_token_bitmask_, masked_argmax_
from formcast.engine.kernels.sampling import greedy_picks, row_seed, sample
from formcast.engine.sampling_params import SamplingParams
from formcast.engine.sequence import Sequence, TokenLogprob
from formcast.engine.tuning import EngineTuning


_CONSTRAINT = operator.attrgetter("constraint")


@dataclass(frozen=True, kw_only=True)
class SampleResult:
    token_ids: list[int]                       # one per row; -1 where the row failed
    logprobs: list[TokenLogprob | None]
    errors: dict[int, str]                     # row -> why it could not be sampled


@dataclass(frozen=True, kw_only=True)
class FilledMasks:
    """Grammar bitmasks of a batch's constrained rows, filled ahead of sampling."""

    rows: list[int]                            # batch rows that have a constraint
    bitmask: torch.Tensor                      # [len(rows), words] int32 (or fewer: shared)
    errors: dict[int, str]                     # row -> why its constraint failed
    ring_slot: int | None = None               # the sampler's pinned buffer it lives in
    # rows in the same state share a mask row: the row of each of ``rows``' masks
    # in ``bitmask`` (None: mask row ``j`` is ``rows[j]``'s)
    shared: list[int] | None = None

    def mask_rows(self, device: torch.device) -> torch.Tensor | None:
        """``shared`` on ``device`` (None when it is None)."""
        return None if self.shared is None else to_device(self.shared, torch.long, device)


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """One verified draft position: the token kept there and whether it was the draft's."""

    token_id: int                              # -1 when ``error`` is set
    accepted: bool
    logprob: TokenLogprob | None
    error: str | None


class Sampler:
    """Samples one token per row of a logits batch for the given sequences."""

    def __init__(self, vocab_size: int, valid_vocab_size: int, *, batch_fill: bool = False,
                 tuning: EngineTuning | None = None, invariant: bool = False) -> None:
        # vocab_size: the model's (logits width); valid_vocab_size: the tokenizer's.
        # batch_fill (set on CUDA): fill masks through a constraint class's
        # ``fill_bitmasks`` (many rows in one call, on the grammar library's threads)
        # where it has one, into pinned memory (the copy to the device is asynchronous)
        tuning = tuning or EngineTuning()
        # batch-invariant mode: draws keyed by (seed, position), not a generator's state
        self.invariant = invariant
        self._spare_rows = tuning.mask_ring_spare_rows  # (past a pinned buffer's masks)
        self._few = {"few_masks": tuning.few_masks, "few_allowed": tuning.few_allowed}
        self.vocab_size = vocab_size
        self.batch_fill = batch_fill
        self._pin = batch_fill and torch.cuda.is_available()
        self.valid_vocab_size = min(valid_vocab_size, vocab_size)
        self.bitmask_width = bitmask_words(vocab_size)  # int32 words per mask row
        self._bitmask = torch.zeros(0, self.bitmask_width, dtype=torch.int32)
        # two pinned mask buffers used in turn (allocating pinned memory costs more
        # than filling it); one is refilled once the device has copied it (event)
        self._ring: list[torch.Tensor | None] = [None, None]
        self._ring_used = [torch.cuda.Event(), torch.cuda.Event()] if self._pin else []
        self._ring_next = 0
        # each ring buffer whole as int64, a tensor and its numpy view (see pinned_ints)
        self._ring_ints: list[tuple[torch.Tensor, object] | None] = [None, None]

    def _bitmask_rows(self, n: int) -> torch.Tensor:
        if self._bitmask.shape[0] < n:
            self._bitmask = torch.zeros(max(n, 2 * self._bitmask.shape[0]),
                                        bitmask_words(self.vocab_size), dtype=torch.int32,
                                        pin_memory=self._pin)
        return self._bitmask[:n]

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence],
                 masks: FilledMasks | None = None) -> SampleResult:
        # logits [B, V] float32, row i belongs to seqs[i]; modified in place.
        # masks: from fill_masks(seqs) (made while the model ran), else filled here
        raw_logprobs = None
        if any(s.params.logprobs is not None for s in seqs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        tokens, dead, errors = self.sample_on_device(logits, seqs, masks)
        # one host sync per step: the sampled tokens and the dead-end flags together
        token_list, dead_list = torch.stack((tokens, dead.long())).tolist()
        token_list = self.finish_rows(token_list, dead_list, errors)
        logprobs: list[TokenLogprob | None] = [None] * len(seqs)
        if raw_logprobs is not None:
            for i, seq in enumerate(seqs):
                if seq.params.logprobs is not None and i not in errors:
                    logprobs[i] = _token_logprob(raw_logprobs[i], token_list[i], seq.params.logprobs)
        return SampleResult(token_ids=token_list, logprobs=logprobs, errors=errors)

    @torch.inference_mode()
    def sample_on_device(self, logits: torch.Tensor, seqs: list[Sequence],
                         masks: FilledMasks | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, dict[int, str]]:
        """The sampling of :meth:`__call__` without its host sync: token ids ``[B]``
        long and dead-end flags ``[B]`` bool, on the logits' device, and the rows
        whose constraint failed (known on the host already)."""
        errors: dict[int, str] = {}
        self._restrict(logits, seqs, errors, filled=masks)
        greedy_rows = [i for i, s in enumerate(seqs) if s.params.greedy]
        if len(greedy_rows) == len(seqs):  # one reduction for both (the first maximum)
            values, tokens = logits.max(dim=-1)
            return tokens, torch.isneginf(values), errors
        else:
            dev = logits.device
            tokens = torch.empty(len(seqs), dtype=torch.long, device=dev)
            if greedy_rows:
                idx = to_device(greedy_rows, torch.long, dev)
                tokens[idx] = logits[idx].argmax(dim=-1)
            drawn = [i for i, s in enumerate(seqs) if not s.params.greedy]
            if (logits.is_cuda and triton_available()) or self.invariant:
                # every drawn row in one kernel, its noise keyed by the request's seed
                # and the position it samples; parameters moved in one async copy
                ps = [seqs[i].params for i in drawn]
                knobs = to_device([[p.temperature for p in ps], [p.top_k or 0 for p in ps],
                                   [p.top_p for p in ps], [p.min_p for p in ps]],
                                  torch.float32, dev)
                seeds = to_device([row_seed(seqs[i].seed, len(seqs[i]))
                                   for i in drawn], torch.long, dev)
                idx = to_device(drawn, torch.long, dev)
                tokens[idx] = sample(logits[idx], knobs[0], knobs[1], knobs[2], knobs[3],
                                     seeds)[0]
            else:
                for i in drawn:
                    tokens[i] = _sample_row(logits[i], seqs[i].params, seqs[i].generator)
        dead = torch.isneginf(logits.max(dim=-1).values)
        return tokens, dead, errors

    def greedy_masked_(self, out: torch.Tensor, logits: torch.Tensor, rows: torch.Tensor,
                       cols: torch.Tensor, filled: FilledMasks,
                       mask_rows: torch.Tensor | None = None, *, pinned: bool = False,
                       source: torch.Tensor | None = None) -> torch.Tensor:
        """Greedy picks under the masks ``filled`` holds (all of its rows
        constrained: ``filled.rows[j]``'s mask is pick ``j``'s), from
        ``logits[rows]`` as they are, into ``out[:, cols]`` (tokens, dead-end
        flags) in one kernel. ``mask_rows``: ``filled.mask_rows`` on the device
        already (read only when ``filled.shared`` is set). ``pinned``: ``rows``,
        ``cols`` and ``mask_rows`` lie in pinned host memory (:meth:`pinned_ints`),
        and the kernel reads them and the masks there. ``source``: the picks
        ``out`` starts from, ``out`` then written whole (see
        :func:`masked_argmax_`). Returns, on the device, whether each pick
        equals the token ``out`` (or ``source``) held there before."""
        agree = torch.empty(len(filled.rows), dtype=torch.bool, device=logits.device)
        if filled.shared is None:
            mask_rows = None
        elif mask_rows is None:
            mask_rows = filled.mask_rows(logits.device)
        masked_argmax_(out, logits, filled.bitmask, rows, cols, agree,
                       vocab_size=self.valid_vocab_size, mask_rows=mask_rows, pinned=pinned,
                       source=source, **self._few)
        if filled.ring_slot is not None:  # on the stream that copies the mask
            self._ring_used[filled.ring_slot].record(current_stream(logits.device))
        return agree

    def greedy_unmasked(self, logits: torch.Tensor) -> torch.Tensor:
        """:func:`greedy_picks` over the tokenizer's vocabulary."""
        return greedy_picks(logits, self.valid_vocab_size)

    @staticmethod
    def finish_rows(token_list: list[int], dead_list: list, errors: dict[int, str]) -> list[int]:
        """Host side of a sampled batch: dead ends join ``errors``; failed rows get -1."""
        for i, is_dead in enumerate(dead_list):
            if is_dead:
                errors.setdefault(i, "the constraint allows no token at this point (dead end)")
        for i in errors:
            token_list[i] = -1
        return token_list

    @torch.inference_mode()
    def verify(self, logits: torch.Tensor, seq: Sequence, proposal: int | None,
               proposal_probs: torch.Tensor | None = None,
               mask: torch.Tensor | None = None) -> Verdict:
        """Sample one position of a speculative draft, losslessly.

        ``logits`` [1, V] is the target's row for the position (modified in place);
        ``proposal`` the draft's token there (None: the bonus position after the
        draft). Under greedy decoding the target's argmax is taken and the proposal
        is accepted when it is that token. Otherwise the proposal is accepted with
        probability min(1, p/q), p the target's masked, tempered distribution and q
        the draft's (a point mass when ``proposal_probs`` is None); on rejection the
        token is drawn from the residual max(0, p - q). The tokens this yields are
        distributed exactly as plain sampling from p. ``mask`` [1, words] is the
        grammar's bitmask for the position when it was filled ahead (else the
        request's constraint fills it now).
        """
        params = seq.params
        raw_logprobs = torch.log_softmax(logits[0], dim=-1) if params.logprobs is not None \
            else None
        errors: dict[int, str] = {}
        self._restrict(logits, [seq], errors, mask)
        row = logits[0]
        if not errors and bool(torch.isneginf(row.max())):
            errors[0] = "the constraint allows no token at this point (dead end)"
        if errors:
            return Verdict(token_id=-1, accepted=False, logprob=None, error=errors[0])
        if params.greedy:
            token = int(row.argmax())
            accepted = proposal is not None and token == proposal
        elif self.invariant:  # the draw plain sampling makes here; the draft kept if equal
            token = int(_keyed_draw(row, seq))
            accepted = proposal is not None and token == proposal
        else:
            probs = _probs(row, params)
            if proposal is None:
                token, accepted = int(_draw(probs, seq.generator)), False
            else:
                q = 1.0 if proposal_probs is None else float(proposal_probs[proposal])
                p = float(probs[proposal]) / float(probs.sum())
                u = float(torch.rand((), generator=seq.generator, device=seq.generator.device))
                accepted = q > 0 and u < min(1.0, p / q)
                if accepted:
                    token = proposal
                else:
                    residual = probs / probs.sum()
                    if proposal_probs is None:
                        residual = residual.clone()
                        residual[proposal] = 0.0
                    else:
                        residual = (residual - proposal_probs.to(residual)).clamp_min_(0.0)
                    if not bool(residual.sum() > 0):
                        residual = probs
                    token = int(_draw(residual, seq.generator))
        logprob = None
        if raw_logprobs is not None:
            logprob = _token_logprob(raw_logprobs, token, params.logprobs)
        return Verdict(token_id=token, accepted=accepted, logprob=logprob, error=None)

    def _restrict(self, logits: torch.Tensor, seqs: list[Sequence], errors: dict[int, str],
                  mask: torch.Tensor | None = None, filled: FilledMasks | None = None) -> None:
        """Set to -inf, in place, what row ``i`` may not sample: ids past the
        tokenizer's vocabulary, what ``seqs[i]``'s constraint forbids (``mask``: every
        row's bitmask, or ``filled``: the constrained rows', when filled ahead) and
        tokens a rollback banned there."""
        if self.valid_vocab_size < self.vocab_size:
            logits[:, self.valid_vocab_size:] = float("-inf")
        if mask is not None:
            apply_token_bitmask_(logits, mask)
        else:
            filled = filled or self.fill_masks(seqs, self._bitmask_rows)
            errors.update(filled.errors)
            if filled.rows:
                every = len(filled.rows) == len(logits)  # then rows are 0..B-1, in order
                bitmask = filled.bitmask
                if filled.shared is not None:  # (a row per constrained row)
                    bitmask = bitmask.to(logits.device, non_blocking=True)[
                        filled.mask_rows(logits.device)]
                apply_token_bitmask_(logits, bitmask, None if every else
                                     to_device(filled.rows, torch.long, logits.device))
                if filled.ring_slot is not None:  # on the stream that copies the mask
                    self._ring_used[filled.ring_slot].record(current_stream(logits.device))
        for i, seq in enumerate(seqs):
            banned = seq.banned_tokens.get(len(seq)) if seq.banned_tokens else None
            if banned:
                logits[i, list(banned)] = float("-inf")

    def fill_masks(self, seqs: list[Sequence], buffer=None) -> FilledMasks:
        """Fill the bitmask of every constrained row of ``seqs`` (their matchers are
        read, not changed). Safe on a worker thread while the model runs: it touches
        only the constraints and its buffer (``buffer(n)`` gives one; else, on CUDA,
        the next of two pinned buffers used in turn, else a fresh tensor)."""
        constraints = list(map(_CONSTRAINT, seqs))
        if None in constraints:
            rows = [i for i, c in enumerate(constraints) if c is not None]
            constraints = [constraints[i] for i in rows]
        else:  # (the usual batch: every row constrained)
            rows = list(range(len(seqs)))
        slot = None
        if buffer is not None:
            bitmask = buffer(len(rows))
        elif self._pin and rows:
            slot, bitmask = self._ring_rows(len(rows))
        else:
            bitmask = torch.empty(len(rows), self.bitmask_width, dtype=torch.int32)
        errors: dict[int, str] = {}
        single = list(range(len(rows)))  # mask rows filled one by one
        if self.batch_fill and len(rows) > 1:
            kinds = set(map(type, constraints))
            kind = kinds.pop() if len(kinds) == 1 else None
            ops = ops_for(kind) if kind is not None else None
            distinct = ops.fill_distinct_bitmasks if ops is not None else None
            if distinct is not None:  # (the usual batch: shared states read shared)
                try:
                    shared = distinct(constraints, bitmask)
                    if shared is not None and (len(shared) != len(rows) or min(shared) < 0
                                               or max(shared) >= len(rows)):
                        raise ValueError("mask rows out of place")
                except Exception:  # the broken one is found row by row below
                    pass
                else:
                    if shared is not None:
                        bitmask = bitmask[:max(shared) + 1]
                    return FilledMasks(rows=rows, bitmask=bitmask, errors=errors,
                                       ring_slot=slot, shared=shared)
            if kind is not None:  # (the usual batch: one class of constraint)
                many = ops.fill_bitmasks
                groups = {many: single} if many is not None else {}
                single = [] if many is not None else single
            else:
                groups, single = {}, []
                for j, constraint in enumerate(constraints):
                    many = ops_for(type(constraint)).fill_bitmasks
                    if many is None:
                        single.append(j)
                    else:
                        groups.setdefault(many, []).append(j)
            for many, js in groups.items():
                try:  # (a batch hook writes its rows whole)
                    many(constraints if len(js) == len(rows) else [constraints[j] for j in js],
                         bitmask, js)
                except Exception:  # find the broken one row by row
                    single.extend(js)
        if single:  # (a constraint's own fill sets the bits of allowed tokens)
            if len(single) == len(rows):
                bitmask.zero_()
            else:
                bitmask[single] = 0
        for j in single:
            i = rows[j]
            try:
                seqs[i].constraint.fill_bitmask(bitmask, j)
            except Exception as exc:  # a broken constraint fails its own request only
                errors[i] = f"constraint failed to fill its mask: {type(exc).__name__}: {exc}"
                bitmask[j] = -1
        return FilledMasks(rows=rows, bitmask=bitmask, errors=errors, ring_slot=slot)

    def _ring_rows(self, n: int) -> tuple[int, torch.Tensor]:
        """The next pinned mask buffer (``n`` rows), once the device has read it.
        Past its mask rows a buffer keeps room for :meth:`pinned_ints`."""
        slot = self._ring_next
        self._ring_next ^= 1
        wait_event(self._ring_used[slot])  # its last copy to the device is done
        buf = self._ring[slot]
        if buf is None or buf.shape[0] < n + self._spare_rows:
            with torch.inference_mode(False):  # a normal tensor: filled in either mode
                buf = torch.empty(max(n, 64) + self._spare_rows, self.bitmask_width,
                                  dtype=torch.int32, pin_memory=True)
                ints = buf.view(torch.int64).view(-1) if self.bitmask_width % 2 == 0 else None
            self._ring[slot] = buf
            self._ring_ints[slot] = None if ints is None else (ints, ints.numpy())
        return slot, buf[:n]

    def pinned_ints(self, filled: FilledMasks, values: list[int]) -> torch.Tensor | None:
        """``values`` as a long tensor in pinned host memory, right after
        ``filled``'s masks in their ring buffer, for a kernel that reads both in
        place (through unified addressing) rather than after copies to the
        device; None when the masks are not in the ring or the room after them
        is too small. The buffer is not filled again before the device is done
        with it (the event :meth:`greedy_masked_` records)."""
        slot = filled.ring_slot
        kept = self._ring_ints[slot] if slot is not None else None
        if kept is None or filled.bitmask.data_ptr() != self._ring[slot].data_ptr():
            return None
        ints, view = kept
        start = filled.bitmask.shape[0] * self.bitmask_width // 2
        end = start + len(values)
        if end > len(view):
            return None
        view[start:end] = values
        return ints[start:end]


def _keyed_draw(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """One token from ``row`` [V] (restricted already) with noise keyed by the
    request's seed and the position sampled (:func:`row_seed`)."""
    p = seq.params
    knobs = torch.tensor([p.temperature, p.top_k or 0, p.top_p, p.min_p], dtype=torch.float32)
    seeds = torch.tensor([row_seed(seq.seed, len(seq))], dtype=torch.long)
    knobs, seeds = knobs.to(row.device), seeds.to(row.device)
    # (the backend plain sampling takes for the row: the same draw)
    return sample(row.unsqueeze(0), knobs[0:1], knobs[1:2], knobs[2:3], knobs[3:4], seeds)[0][0]


def _sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
                ) -> torch.Tensor:
    # logits [V] -> scalar token id
    return _draw(_probs(logits, params), generator)


def _probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from: [V] logits -> [V] probabilities (not
    renormalized after top-p / min-p cuts; draws do not need it)."""
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[0]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # drop a token when the mass strictly before it already reaches top_p
        drop_sorted = (sorted_probs.cumsum(0) - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs


def _draw(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw proportional to ``weights`` [V] (need not sum to 1): the exponential race."""
    race = torch.empty_like(weights).exponential_(generator=generator)
    return (weights / race).argmax()


def _token_logprob(logprobs: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    top: tuple[tuple[int, float], ...] = ()
    if k:
        values, ids = torch.topk(logprobs, k)
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token_id=token_id, logprob=float(logprobs[token_id]), top=top)
