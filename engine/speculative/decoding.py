"""Speculative decoding in the engine's step: who drafts, how long, and the
verification of a draft against the target's logits.

A step's requests in decode get drafts from the proposers (grammar-forced tokens,
prompt lookup, an MTP head), cut to the lengths :func:`choose_lengths` finds worth
verifying; one forward scores every draft position; :meth:`SpeculativeDecoder.verify`
keeps the longest prefix the target agrees with (``Sampler.verify``: lossless
rejection sampling under the grammar's masks, exact match when greedy) and one
token of the target's own.
"""

from __future__ import annotations

import torch

from formcast.engine.block_manager import BlockManager
from formcast.engine.output import OutputProcessor, dead_end_message
from formcast.engine.sampler import Sampler
from formcast.engine.sequence import Sequence
from formcast.engine.speculative.config import SpecConfig
from formcast.engine.speculative.mtp import MTPProposer
from formcast.engine.speculative.proposers import (DraftMemory, JumpForwardProposer,
                                                   PromptLookupProposer, fill_draft_masks,
                                                   propose)
from formcast.engine.speculative.schedule import StepCostModel, choose_lengths
from formcast.engine.tokenizer import Tokenizer
from formcast.engine.tuning import EngineTuning


class SpeculativeDecoder:
    """Drafts for a step's requests, and their verification.

    Parameters
    ----------
    spec : SpecConfig
        What drafts, and how much.
    tokenizer : Tokenizer
        For prompt lookup by text.
    sampler : Sampler
        Verifies each draft position.
    block_manager : BlockManager
        Gives back the blocks of rejected positions.
    output : OutputProcessor
        Appends the accepted tokens.
    dtype : torch.dtype
        The engine's: "auto" drafts on float32 engines only.
    max_batched_tokens : int
        A step's token budget.
    tuning : EngineTuning
        Prompt lookup's text search.
    mtp : MTPProposer | None
        A model's own draft head, when it has one.
    """

    def __init__(self, spec: SpecConfig, tokenizer: Tokenizer, sampler: Sampler,
                 block_manager: BlockManager, output: OutputProcessor, *, dtype: torch.dtype,
                 max_batched_tokens: int, tuning: EngineTuning,
                 mtp: MTPProposer | None = None) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.sampler = sampler
        self.block_manager = block_manager
        self.output = output
        self.dtype = dtype
        self.max_batched_tokens = max_batched_tokens
        self.tuning = tuning
        self.mtp = mtp
        self.step_cost = StepCostModel()  # seconds per step by tokens, learned online
        self.memory: DraftMemory | None = None  # the model's habits, for drafting

    def drafts(self, running: list[Sequence]) -> bool:
        """Whether a step of ``running`` would draft for any of them (see
        :meth:`draft_mode`)."""
        mode = self.draft_mode(len(running))
        return mode == "all" or mode == "forced" and any(s.constraint is not None
                                                         for s in running)

    def propose(self, running: list[Sequence]) -> None:
        """Give every running request in decode a draft to verify in this step."""
        spec = self.spec
        mode = self.draft_mode(len(running))
        if mode is None:
            return
        auto = spec.method == "auto"
        forced_only = mode == "forced"
        if self.memory is None:
            self.memory = DraftMemory(self.tokenizer.token_bytes())
        memory = self.memory
        proposers = (JumpForwardProposer(memory),
                     PromptLookupProposer(spec.ngram_max, spec.ngram_min, memory=memory,
                                          encode=self._encode_plain,
                                          text_window=self.tuning.lookup_text_window,
                                          text_tries=self.tuning.lookup_text_tries,
                                          text_bytes=self.tuning.lookup_text_bytes))
        if self.mtp is not None or forced_only:  # grammar-forced tokens (then the MTP draft)
            proposers = proposers[:1]
        drafting: list[Sequence] = []
        for_mtp: list[Sequence] = []
        others = 0  # tokens the step runs anyway
        for seq in running:
            seq.draft = None
            others += min(seq.num_uncomputed_tokens, self.max_batched_tokens)
            if seq.num_uncomputed_tokens != 1 or (auto and not seq.params.greedy) \
                    or (forced_only and seq.constraint is None):
                continue
            room = min(spec.max_draft, seq.max_total_len - len(seq) - 1)
            if room > 0:
                draft = propose(seq, spec, room, proposers)
                if draft.tokens:
                    seq.draft = draft
                    drafting.append(seq)
                elif self.mtp is not None and not forced_only:
                    for_mtp.append(seq)
        if for_mtp:
            for seq, draft in zip(for_mtp, self.mtp.propose_batch(for_mtp)):
                if draft.tokens and draft.confidence[0] >= spec.min_confidence:
                    seq.draft = draft
                    drafting.append(seq)
        if drafting:
            lengths = choose_lengths([s.draft.confidence for s in drafting], others,
                                     self.step_cost) if spec.scheduled \
                else [len(s.draft.tokens) for s in drafting]
            for seq, n in zip(drafting, lengths):
                seq.draft = seq.draft.cut(n) if n else None
                if seq.draft is not None and seq.constraint is not None:
                    seq.draft.masks = fill_draft_masks(seq.constraint, seq.draft.tokens,
                                                       self.sampler.bitmask_width)

    def draft_mode(self, num_running: int) -> str | None:
        """What a step drafts: None, "forced" (grammar-forced tokens only) or "all".
        "auto" only drafts where outputs cannot change: greedy requests, float32
        (bfloat16 GEMMs round differently for 1 and 1 + draft rows); past
        ``auto_max_batch`` requests only what a grammar forces, which costs a row of
        this step and saves a whole step later."""
        spec = self.spec
        if not spec.enabled:
            return None
        if spec.method != "auto":
            return "all"
        if self.dtype != torch.float32:
            return None
        return "forced" if num_running > spec.auto_max_batch else "all"

    def _encode_plain(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def verify(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Accept the longest prefix of ``seq.draft`` the target agrees with, then one
        token of the target's own; ``logits`` [1 + d, V] scores the last token and
        each draft position. Rejected positions leave no trace: their KV is beyond
        ``num_computed_tokens`` (overwritten later) and the matcher never saw them."""
        draft, seq.draft = seq.draft, None
        d = len(logits) - 1
        seq.num_draft_tokens += d
        seq.num_verification_tokens += d + 1
        lookup_seen = lookup_ok = 0
        accepted, chosen = 0, None
        for j in range(d + 1):
            proposal = draft.tokens[j] if j < d else None
            q = draft.probs[j] if draft.probs is not None and j < d else None
            mask = draft.masks[j:j + 1] if draft.masks is not None and j < len(draft.masks) \
                else None
            verdict = self.sampler.verify(logits[j:j + 1], seq, proposal, q, mask)
            if verdict.error is not None:
                if not self.output.roll_back_dead_end(seq):
                    seq.error = dead_end_message(seq, verdict.error)
                    self.output.finish(seq, "abort")
                break
            if j < d and draft.source(j) == "lookup":
                lookup_seen += 1
                lookup_ok += verdict.accepted
            self.output.append_token(seq, verdict.token_id, verdict.logprob)
            if verdict.accepted:
                accepted += 1
                seq.num_accepted_draft_tokens += 1
                seq.num_forced_tokens += draft.source(j) == "forced"
                if not seq.is_finished:
                    seq.num_computed_tokens += 1  # its KV was computed in this step
            elif j < d:
                chosen = verdict.token_id
            if seq.is_finished or not verdict.accepted:
                break
        seq.spec_lookup_proposed += lookup_seen
        seq.spec_lookup_accepted += lookup_ok
        if self.memory is not None and not seq.is_finished:
            self.memory.observe(seq, draft, accepted, chosen)
        if not seq.is_finished:
            # give back blocks that only held rejected positions; hash full blocks
            self.block_manager.truncate(seq, seq.num_computed_tokens)
            self.block_manager.commit(seq)
