"""Batched sampling with temperature, top-k, top-p and min-p, one seed per row.

Each row keeps the tokens whose logit reaches a threshold (the lowest kept logit):
top-k keeps the k largest logits (ties at the k-th all kept), top-p then the
smallest set of most likely tokens whose probability (softmax of the kept logits
at the temperature) reaches p, min-p those at least ``min_p`` times the most
likely one. A kept token is drawn with the Gumbel-max race, ``argmax(x / T + g)``,
``g`` standard Gumbel noise from the row's seed, which samples exactly from the
tempered distribution over the kept tokens. Rows depend on their own logits and
seed only, so a request samples the same tokens in any batch.

The torch path is the reference (thresholds from a sort; noise from a CPU
generator per row); Triton runs on CUDA tensors with counter-based noise
(Philox) and no host synchronisation.
"""

from __future__ import annotations

import torch

from formcast.engine.kernels import use_triton

_MASK64 = (1 << 64) - 1


def greedy_picks(logits: torch.Tensor, vocab_size: int | None = None, *,
                 backend: str = "auto") -> torch.Tensor:
    """``[2, B]`` long: each row's argmax over its first ``vocab_size`` columns (the
    first maximum) and whether the row is a dead end (all ``-inf``); ``logits``
    are left as they are. Triton (a split kernel) takes CUDA rows that are contiguous."""
    if use_triton(logits, backend) and logits.stride(1) == 1:
        from formcast.engine.kernels.sampling_triton import greedy_picks_triton

        width = logits.shape[1]
        return greedy_picks_triton(logits, width if vocab_size is None else min(vocab_size, width))
    values, ids = logits[:, :vocab_size].max(dim=-1)
    return torch.stack((ids, torch.isneginf(values).long()))


def row_seed(seed: int, position: int) -> int:
    """A 31-bit seed for one draw of a request: its seed and the position sampled,
    mixed (splitmix64), so consecutive positions get unrelated noise."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & 0x7FFFFFFF


def sampling_thresholds(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                        top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Reference: the lowest logit each row keeps ``[B]`` (float32). ``logits``
    [B, V] float32 (-inf where masked); per-row ``temperature`` (> 0), ``top_k``
    (0: off), ``top_p`` (1: off), ``min_p`` (0: off)."""
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for i in range(logits.shape[0]):
        x = logits[i].float()
        t = float(temperature[i])
        if bool(torch.isneginf(x).all()):  # a dead end: nothing to keep (the sampler flags it)
            out[i] = float("-inf")
            continue
        if int(top_k[i]) == 0 and float(top_p[i]) >= 1.0 and float(min_p[i]) <= 0.0:
            out[i] = x[x > float("-inf")].min()  # nothing cut: the lowest finite logit
            continue
        values = x.sort(descending=True).values
        values = values[values > float("-inf")]
        thr = float(values[-1])
        k = int(top_k[i])
        if 0 < k < len(values):
            thr = float(values[k - 1])
        kept = values[values >= thr]
        p = float(top_p[i])
        if p < 1.0:
            probs = torch.softmax(kept / t, dim=0)
            before = probs.cumsum(0) - probs
            last = int((before < p).sum()) - 1        # keep while the mass before < p
            thr = max(thr, float(kept[last]))
        mp = float(min_p[i])
        if mp > 0.0:
            thr = max(thr, float(kept[0]) + t * float(torch.log(torch.tensor(mp))))
        out[i] = thr
    return out


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor, *,
           backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row. Returns (token ids ``[B]`` long, thresholds ``[B]``:
    the lowest logit each row kept). Arguments as :func:`sampling_thresholds`, plus
    ``seeds`` [B] (e.g. :func:`row_seed` of the request and position)."""
    if logits.shape[0] == 0:
        return (torch.empty(0, dtype=torch.long, device=logits.device),
                torch.empty(0, dtype=torch.float32, device=logits.device))
    if use_triton(logits, backend) and logits.stride(1) == 1:
        from formcast.engine.kernels.sampling_triton import sample_triton

        return sample_triton(logits, temperature, top_k, top_p, min_p, seeds)
    thr = sampling_thresholds(logits, temperature, top_k, top_p, min_p)
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    for i in range(logits.shape[0]):
        gen = torch.Generator(device=logits.device).manual_seed(int(seeds[i]))
        u = torch.rand(logits.shape[1], generator=gen, device=logits.device)
        gumbel = -torch.log(-torch.log(u.clamp_min(1e-20)))
        x = logits[i].float()
        score = torch.where(x >= thr[i], x / temperature[i] + gumbel, float("-inf"))
        tokens[i] = score.argmax()
    return tokens, thr
