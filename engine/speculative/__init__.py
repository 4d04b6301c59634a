"""Speculative decoding: drafts validated against the grammar, verified losslessly.

Each step, a request in decode gets a draft: the tokens its grammar forces
(jump-forward, always kept) and then a prompt-lookup continuation (an n-gram of
the recent context found earlier in the prompt or output, followed forward). The
draft is cut at the first token the request's constraint rejects
(``valid_prefix``) and where its estimated survival probability drops below
``SpecConfig.min_confidence``. One forward pass of the target model scores the
last token and every draft position; ``SpeculativeDecoder.verify`` (with
``Sampler.verify`` at each position) accepts the longest prefix the target agrees with (rejection sampling against the masked
target distribution; exact match under greedy), then adds one token of its own,
so every step yields at least the token a plain step would. Rejected positions
are rolled back in the KV cache (nothing of them is ever committed to the
matcher).
"""

from formcast.engine.speculative.config import SpecConfig
from formcast.engine.speculative.proposers import (Draft, JumpForwardProposer, PromptLookupProposer,
                                            Proposer, propose)

__all__ = ["Draft", "JumpForwardProposer", "PromptLookupProposer", "Proposer", "SpecConfig",
           "propose"]
