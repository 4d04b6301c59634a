"""Confidence-scheduled verification: how many draft positions a step verifies.

The engine records how long its steps take as a function of the tokens they run
(:class:`StepCostModel`, learned online from its own steps, so it fits the machine,
the dtype and the kernels actually used). Each step, draft positions of all
requests are ranked by their survival probability (the proposer's confidence), and
the step verifies the prefix of that ranking that maximizes expected output tokens
per second: ``(requests + sum of chosen confidences) / cost(tokens in the step)``.
Where the step time hardly grows with its token count (a memory-bound CPU or GPU
step), long drafts are verified; where it grows steeply, only near-certain ones.
"""

from __future__ import annotations

import bisect


class StepCostModel:
    """Seconds per step by tokens per step: an exponential moving average for every
    count seen, linear interpolation between them, optimistic (flat) beyond."""

    def __init__(self, decay: float = 0.2) -> None:
        self.decay = decay
        self._counts: list[int] = []           # sorted token counts seen
        self._seconds: dict[int, float] = {}

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        old = self._seconds.get(tokens)
        if old is None:
            bisect.insort(self._counts, tokens)
            self._seconds[tokens] = seconds
        else:
            self._seconds[tokens] = old + self.decay * (seconds - old)

    def cost(self, tokens: int) -> float | None:
        """Predicted seconds for a step of ``tokens`` tokens (None: nothing seen yet).

        Counts never seen are interpolated between their neighbours, and take the
        nearest seen count's time outside them: unseen sizes look cheap, so they get
        tried, and then the measurement decides.
        """
        if not self._counts:
            return None
        if tokens in self._seconds:
            return self._seconds[tokens]
        i = bisect.bisect_left(self._counts, tokens)
        if i == 0:
            return self._seconds[self._counts[0]]
        if i == len(self._counts):
            return self._seconds[self._counts[-1]]
        lo, hi = self._counts[i - 1], self._counts[i]
        f = (tokens - lo) / (hi - lo)
        return self._seconds[lo] + f * (self._seconds[hi] - self._seconds[lo])


def choose_lengths(confidences: list[list[float]], base_tokens: int,
                   cost: StepCostModel) -> list[int]:
    """Draft positions to verify per request: the best prefix of all positions ranked
    by confidence, for expected tokens per second.

    ``confidences[r]`` are request r's draft confidences (non-increasing: survival
    probabilities along its draft); ``base_tokens`` the tokens the step runs anyway
    (one per request in decode, plus prefill chunks).
    """
    ranked = sorted(((c, r) for r, cs in enumerate(confidences) for c in cs), reverse=True)
    if not ranked:
        return [0] * len(confidences)
    base = cost.cost(base_tokens)
    if base is None:  # nothing measured yet: verify everything once
        return [len(cs) for cs in confidences]
    requests = len(confidences)
    best_k, best_rate = 0, requests / base
    expected = float(requests)
    for k, (c, _r) in enumerate(ranked, start=1):
        expected += c
        rate = expected / cost.cost(base_tokens + k)
        if rate > best_rate:
            best_k, best_rate = k, rate
    lengths = [0] * len(confidences)
    for _c, r in ranked[:best_k]:
        lengths[r] += 1
    return lengths
