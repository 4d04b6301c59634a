"""Per-request sampling parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass

from formcast.engine.errors import RequestError


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request's tokens are chosen and when it stops.

    Parameters
    ----------
    max_tokens : int
        Most tokens to generate (> 0).
    temperature : float
        0 means greedy (argmax); otherwise logits are divided by it.
    top_k : int
        Keep the k most likely tokens; 0 keeps all.
    top_p : float
        Nucleus sampling: keep the smallest set whose probability reaches top_p.
    min_p : float
        Drop tokens whose probability is below ``min_p`` times the top probability.
    seed : int | None
        Seed of this request's own generator: the same seed and request give the
        same tokens whatever else is in the batch. None draws a fresh seed.
    stop : tuple[str, ...]
        Strings that end generation; the text is cut before them.
    stop_token_ids : tuple[int, ...]
        Token ids that end generation, in addition to the tokenizer's eos ids.
    ignore_eos : bool
        Keep generating past eos tokens (benchmarks).
    logprobs : int | None
        None: no log-probs. k >= 0: the sampled token's log-prob plus the k most
        likely alternatives at every step, from the model's distribution before
        constraints, temperature and truncation.
    include_stop_str_in_output : bool
        Keep the matched stop string at the end of the text.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be >= 0 and finite, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise RequestError(f"seed must be a non-negative integer or None, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError(f"stop must hold non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise RequestError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise RequestError(f"logprobs must be None or an integer >= 0, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
