"""What a generation call returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Usage:
    """Token counts and timing of one call.

    Attributes
    ----------
    prompt_tokens, completion_tokens : int
    cached_prompt_tokens : int
        Prompt tokens served from the prefix cache.
    latency_s : float
        From submission to the last token.
    time_to_first_token_s : float | None
    draft_tokens, accepted_draft_tokens, forced_tokens, verification_tokens : int
        Speculative decoding: draft tokens verified, how many of them were accepted
        (they are part of ``completion_tokens``), how many of those the grammar
        forced (jump-forward), and the positions the model scored to verify them.
    """

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    latency_s: float
    time_to_first_token_s: float | None
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    forced_tokens: int = 0
    verification_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, kw_only=True)
class Completion:
    """The result of :meth:`formcast.LLM.generate`.

    Attributes
    ----------
    text : str
        The generated text (stop strings and eos excluded).
    token_ids : tuple[int, ...]
    finish_reason : str
        "stop" (eos, stop string, or the constraint completed), "length"
        (``max_tokens`` reached) or "abort".
    usage : Usage
    value : Any
        The parsed value for ``json_schema`` / ``output_type`` / ``choices`` calls
        (None for free text, regex and grammar calls, and when the output is incomplete).
    field_confidence : dict[str, float] | None
        For ``extract(..., return_completions=True)``: the mean token log-prob, in
        (-inf, 0], of each value of the output, keyed by JSON pointer (``/name``,
        ``/items/0/sku``); a low one marks a field to check. None otherwise.
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    usage: Usage
    value: Any = None
    field_confidence: dict[str, float] | None = None
