"""Scoring continuations on the paged KV cache: the log-probs of given tokens.

:func:`continuation_logprobs` serves ``extract``'s choice of grounded numbers
(:mod:`formcast.extraction_numbers`): many short continuations of a few long
prefixes (a prompt and an output up to a field). Each prefix is computed once,
from the prefix cache's blocks (a finished request's prompt and output stay there
while it keeps them), and a prefix that begins another is computed with it; each
continuation then forks its prefix's KV (:meth:`BlockManager.fork`: full blocks
shared, the last partial one copied) and computes only its own tokens but the
last, the logits of the rows wanted only. All of them in a few steps, outside the
scheduler (the engine drains its pipeline first); nothing is cached from them.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from typing import TYPE_CHECKING

import torch

from formcast.engine.errors import RequestError
from formcast.engine.sampling_params import SamplingParams
from formcast.engine.scheduler import ScheduledSeq
from formcast.engine.sequence import Sequence

if TYPE_CHECKING:
    from formcast.engine.engine import Engine


def continuation_logprobs(engine: Engine, prefixes: SequenceABC[SequenceABC[int]],
                          continuations: SequenceABC[SequenceABC[SequenceABC[int]]]
                          ) -> list[list[list[float]]]:
    """Per prefix, per continuation of it, the log-probability of each of its tokens
    after the prefix (and the continuation's tokens before it), as generated tokens
    are run; in passes of at most ``max_num_seqs`` continuations.

    Raises
    ------
    RequestError
        An empty prefix or continuation, or too few free KV blocks for a pass now.
    """
    items = [(list(p), [list(c) for c in conts]) for p, conts in zip(prefixes, continuations)]
    if any(not p for p, _ in items) or any(not c for _, conts in items for c in conts):
        raise RequestError("continuation_logprobs needs non-empty prefixes and continuations")
    out: list[list[list[float]]] = []
    start = 0
    while start < len(items):  # (passes of at most max_num_seqs continuations)
        end, held = start + 1, len(items[start][1])
        while end < len(items) and held + len(items[end][1]) <= engine.config.max_num_seqs:
            held += len(items[end][1])
            end += 1
        for (_, conts), (first, rows) in zip(items[start:end],
                                             _logprob_rows(engine, items[start:end])):
            out.append([[float(first[c[0]])] + r.gather(1, torch.tensor(c[1:])[:, None])
                        .squeeze(1).tolist() for c, r in zip(conts, rows)])
        start = end
    return out

@torch.inference_mode()
def _logprob_rows(engine: Engine, items: list[tuple[list[int], list[list[int]]]]
                  ) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Per (prefix, continuations): the log-softmax row ``[V]`` of the token after
    the prefix, and per continuation the rows ``[len - 1, V]`` that predict its
    tokens after the first. A prefix that begins another is computed with it."""
    bm = engine.block_manager
    seqs: list[Sequence] = []

    def make(ids: list[int], parent: Sequence | None = None, shared: int = 0) -> Sequence:
        """A sequence of ``ids`` whose first ``shared`` tokens' KV is ``parent``'s, or
        else the prefix cache's before them."""
        seq = engine.intake.make(ids[:shared], SamplingParams(max_tokens=1), None,
                               engine.intake.next_id("score"))
        seqs.append(seq)
        if parent is None:
            bm.allocate_prefix(seq)  # (the blocks before its last token)
        else:
            engine.runner.copy_blocks(bm.fork(parent, seq, shared))
        seq.token_ids += ids[shared:]
        seq.num_prompt_tokens = len(seq)
        if not bm.can_grow(seq, len(seq) - seq.num_computed_tokens):
            raise RequestError(f"not enough free KV blocks for {len(seq)} tokens now")
        bm.grow(seq, len(seq) - seq.num_computed_tokens)
        return seq

    try:
        longest: list[list[int]] = []    # (the prefixes no other one extends)
        for prefix, _ in sorted(items, key=lambda item: -len(item[0])):
            if not any(p[:len(prefix)] == prefix for p in longest):
                longest.append(prefix)
        owner = [next(k for k, p in enumerate(longest) if p[:len(prefix)] == prefix)
                 for prefix, _ in items]
        at = [sorted({len(prefix) - 1 for (prefix, _), k in zip(items, owner) if k == j})
              for j in range(len(longest))]
        # (computed from the block of the first position whose logits are wanted)
        parents = [make(p, shared=rows[0] + 1) for p, rows in zip(longest, at)]
        found = _rows(engine, parents, at)
        firsts = [found[k][at[k].index(len(prefix) - 1)] for (prefix, _), k in zip(items, owner)]
        children = [make(prefix + c[:-1], parents[k], len(prefix)) for (prefix, conts), k
                    in zip(items, owner) for c in conts if len(c) > 1]
        rows = iter(_rows(engine, children, [list(range(s.num_computed_tokens, len(s)))
                                          for s in children]))
        empty = torch.empty(0, firsts[0].shape[-1])
        return [(first, [next(rows) if len(c) > 1 else empty for c in conts])
                for first, (_, conts) in zip(firsts, items)]
    finally:
        for seq in seqs:
            bm.free(seq)
            engine.runner.release(seq)

def _rows(engine: Engine, seqs: list[Sequence], wanted: list[list[int]]) -> list[torch.Tensor]:
    """Compute the rest of each of ``seqs`` (whole sequences a step while they fit
    the step budget, else in chunks); the log-softmax rows of the positions
    ``wanted[i]`` (ascending) of each."""
    budget = engine.config.max_num_batched_tokens
    picked: list[list[torch.Tensor]] = [[] for _ in seqs]
    todo = [i for i, seq in enumerate(seqs) if seq.num_computed_tokens < len(seq)]
    while todo:
        batch, rows, used = [], [], 0
        for i in todo:
            seq = seqs[i]
            n = min(len(seq) - seq.num_computed_tokens, budget - used)
            if n <= 0:
                break
            at = seq.num_computed_tokens  # (the logits of the positions wanted only)
            span = [p for p in wanted[i] if at <= p < at + n]
            batch.append((i, ScheduledSeq(seq=seq, num_tokens=n), len(span)))
            rows += [used + p - at for p in span]
            used += n
        logits = engine.runner.execute([b for _, b, _ in batch], rows=rows,
                                     prompt_float=False).cpu()
        at = 0
        for i, item, k in batch:
            picked[i].append(logits[at:at + k])
            at += k
            item.seq.num_computed_tokens += item.num_tokens
        todo = [i for i in todo if seqs[i].num_computed_tokens < len(seqs[i])]
    return [torch.log_softmax(torch.cat(p), dim=-1) for p in picked]
