"""The model's own MTP (next-n) layer as a draft proposer.

DeepSeek-V4 ships one MTP layer: from the main model's streams at the last computed
position and the token just sampled, it predicts the token after that. It drafts
one token per step (MTP depth 1), with its distribution for lossless rejection
sampling and its own probability of the drafted token as the confidence.

The draft distribution is restricted the way the target's will be when verified
(tokenizer vocabulary, the request's grammar at this point, tokens a rollback
banned), so a draft is always valid under the constraint; greedy requests take its
argmax, sampled ones draw from it (temperature applied) with their own generator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from formcast.engine.constraint import bitmask_words
from formcast.engine.kernels.bitmask import apply_token_bitmask_
from formcast.engine.speculative.proposers import Draft, Proposer

if TYPE_CHECKING:
    from formcast.engine.models.deepseek_v4_runner import DeepseekV4Runner
    from formcast.engine.sequence import Sequence


class MTPProposer(Proposer):
    """Drafts one token per request with the MTP layer of the runner's model.

    Parameters
    ----------
    runner : DeepseekV4Runner
        Built with ``keep_hidden=True``; its states carry the MTP layer's window.
    valid_vocab_size : int
        Tokens the tokenizer has; ids past it (a padded model vocabulary) are never drafted.
    """

    def __init__(self, runner: "DeepseekV4Runner", *, valid_vocab_size: int) -> None:
        self.runner = runner
        self.valid_vocab_size = valid_vocab_size

    def propose(self, seq: "Sequence", context: list[int], max_tokens: int) -> Draft:
        """A one-token draft after ``seq``'s last token; empty when ``context`` runs past
        the request's tokens (the MTP layer drafts only from computed streams), when
        ``max_tokens < 1`` or when the grammar allows nothing. Advances the runner's
        MTP state of ``seq`` (not the request)."""
        if max_tokens < 1 or len(context) != len(seq.token_ids):
            return Draft()
        return self.propose_batch([seq])[0]

    def propose_batch(self, seqs: list["Sequence"]) -> list[Draft]:
        """One-token drafts for requests in decode, the MTP layer run once for all."""
        if not seqs:
            return []
        logits = self.runner.mtp_logits(seqs).clone()  # [B, V] float32
        if self.valid_vocab_size < logits.shape[1]:
            logits[:, self.valid_vocab_size:] = float("-inf")
        constrained = [i for i, s in enumerate(seqs) if s.constraint is not None]
        if constrained:
            masks = torch.zeros(len(constrained), bitmask_words(logits.shape[1]), dtype=torch.int32)
            for j, i in enumerate(constrained):
                try:
                    seqs[i].constraint.fill_bitmask(masks, j)
                except Exception:  # a broken constraint fails its own request, in the sampler
                    masks[j] = 0
            apply_token_bitmask_(logits, masks.to(logits.device),
                                 torch.tensor(constrained, device=logits.device))
        drafts = []
        for i, seq in enumerate(seqs):
            row = logits[i]
            banned = seq.banned_tokens.get(len(seq)) if seq.banned_tokens else None
            if banned:
                row[list(banned)] = float("-inf")
            if bool(torch.isneginf(row.max())):
                drafts.append(Draft())
                continue
            if seq.params.greedy:
                probs = torch.softmax(row, dim=-1)
                token = int(row.argmax())
                drafts.append(Draft([token], [float(probs[token])], sources=["mtp"]))
            else:
                # drawn where the request's generator lives (the verifying logits' device)
                probs = torch.softmax(row.to(seq.generator.device) / seq.params.temperature, dim=-1)
                race = torch.empty_like(probs).exponential_(generator=seq.generator)
                token = int((probs / race).argmax())
                drafts.append(Draft([token], [float(probs[token])], sources=["mtp"], probs=[probs]))
        return drafts
