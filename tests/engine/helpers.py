"""Small builders shared by the engine tests (no model needed)."""

from __future__ import annotations

import torch

from formcast.engine.sampling_params import SamplingParams
from formcast.engine.sequence import Sequence


def make_seq(ids: list[int], *, rid: str = "r", max_tokens: int = 8, seed: int = 0,
             max_len: int = 10_000, **params) -> Sequence:
    return Sequence(rid, ids, SamplingParams(max_tokens=max_tokens, **params), None,
                    torch.Generator().manual_seed(seed), max_len)
