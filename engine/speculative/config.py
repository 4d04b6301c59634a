"""Speculative decoding options."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("auto", "prompt_lookup", "mtp", "none")


@dataclass(frozen=True, kw_only=True)
class SpecConfig:
    """How the engine drafts and verifies.

    Parameters
    ----------
    method : {"auto", "prompt_lookup", "mtp", "none"}
        "prompt_lookup" drafts for every request in decode. "mtp" drafts one
        token per step with the model's MTP layer (DeepSeek-V4 checkpoints that
        carry ``mtp.0.*`` weights), with its distribution for rejection sampling;
        grammar-forced tokens go first where there are any. "auto" uses the MTP
        layer when the model has one, prompt lookup otherwise, and drafts for
        greedy requests of float32 engines only (bfloat16 GEMMs round differently
        for 1 and 1 + draft rows, which can flip near-tied argmaxes); while more
        than ``auto_max_batch`` requests run, only grammar-forced tokens (a full
        batch is compute-bound: a guessed position gains little, a forced one
        saves a step);
        greedy outputs are the same with or without drafts, so "auto" does not
        change a result. Sampled requests
        under "prompt_lookup" or "mtp" keep their exact distribution, but a seed's tokens
        differ from a run without speculation. "none" turns speculation off.
    max_draft : int
        Most draft tokens verified per request and step (forced tokens included);
        the schedule verifies fewer where they do not pay. 8 measured best on a
        2-core CPU (docs/performance.md).
    ngram_max, ngram_min : int
        Longest and shortest context suffix looked up in the prompt and output.
    min_confidence : float
        Draft positions whose estimated probability of surviving verification
        (the request's smoothed acceptance rate, compounded along the draft) falls
        below this are not verified. Forced tokens have confidence 1.
    auto_max_batch : int
        Running requests above which ``method="auto"`` drafts grammar-forced
        tokens only.
    scheduled : bool
        True: each step verifies the draft positions worth their cost under the
        engine's measured step times (confidence-scheduled). False: every draft
        position above ``min_confidence`` is verified (for tests and for measuring
        drafts by themselves).
    """

    method: str = "auto"
    max_draft: int = 8
    ngram_max: int = 4
    ngram_min: int = 1
    min_confidence: float = 0.02
    auto_max_batch: int = 8
    scheduled: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"spec method must be one of {METHODS}, got {self.method!r}")
        if self.max_draft < 0:
            raise ValueError(f"max_draft must be >= 0, got {self.max_draft}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, "
                             f"{self.ngram_max}")
        if not 0.0 <= self.min_confidence <= 1.0:
            raise ValueError(f"min_confidence must be in [0, 1], got {self.min_confidence}")
        if self.auto_max_batch < 1:
            raise ValueError(f"auto_max_batch must be >= 1, got {self.auto_max_batch}")

    @classmethod
    def coerce(cls, spec: "SpecConfig | str | None") -> "SpecConfig":
        """``None`` -> default, a method name -> that method with defaults."""
        if spec is None:
            return cls()
        if isinstance(spec, str):
            return cls(method=spec)
        if isinstance(spec, cls):
            return spec
        raise TypeError(f"spec must be a SpecConfig, a method name or None, got {spec!r}")

    @property
    def enabled(self) -> bool:
        return self.method != "none" and self.max_draft > 0
