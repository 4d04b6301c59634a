"""Batch-invariant attention over the paged KV cache (CPU, torch).

One computation for every query row, prefill or decode: a row attends to the
first ``limit`` keys of its sequence (``limit`` = its position + 1), and its
result depends only on its query, those keys and values, and two fixed sizes:

- **Row tiles.** The GEMMs see a row count that is a multiple of
  :data:`ROW_TILE` (a decode row's query heads are padded up to it), so the BLAS
  never takes its few-row kernels, whose reduction order differs from the
  many-row ones (MKL's sgemm computes a row the same way from 4 rows on, at
  any larger row count and any batch of matrices: tests/engine/test_batch_invariance.py
  checks it); one row then gets the same bits alone, among a batch's decode
  rows, or inside a prompt chunk of any length. The tile is that small because
  every padded row costs a whole row of scores, exponentials and products.
- **A fixed KV split.** Keys are taken in splits of :data:`KV_SPLIT` from
  position 0. Scores are one product over the head dim (never split); the
  softmax's maximum is exact in any order; each split's weighted values and
  weight sum are reduced over exactly :data:`KV_SPLIT` keys, and the splits are
  added left to right (a scan), so splits past a row's context add exact zeros
  and a longer batch neighbour changes nothing.

So a token attended in a prompt chunk, in a decode step, or in a verification
step gets the same bits, whatever else runs in the step.

Shapes: T tokens, H query heads, Hkv kv heads, G = H / Hkv, D head dim, N
groups (a prompt chunk, or one decode row), R rows of a group padded to the
row tile, S keys padded to the split, C = :data:`KV_SPLIT`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_TILE = 4
KV_SPLIT = 64


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def masked_keys(limits: torch.Tensor, width: int, window: int | None = None) -> torch.Tensor:
    """``[..., width]`` bool, True at the keys past each row's ``limits`` [...], and
    with a sliding ``window``, at the keys before its last ``window``."""
    keys = torch.arange(width, device=limits.device)
    out = keys >= limits.unsqueeze(-1)
    if window is not None:
        out |= keys < (limits - window).unsqueeze(-1)
    return out


def attend_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked_out: torch.Tensor,
                 scale: float, softcap: float | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The invariant core. ``q`` [N, R, D] (R a multiple of :data:`ROW_TILE`),
    ``k``, ``v`` [N, S, D] (S a multiple of :data:`KV_SPLIT`), ``masked_out``
    [N, R, S] bool (or broadcasting to it): :func:`masked_keys` of the keys each
    row sees, ``0 .. limit - 1`` (at least one, unless ``sinks``). ``softcap``:
    scores become ``softcap * tanh(score / softcap)``. ``sinks`` [N, R, 1] float32
    (or broadcasting to it): one more logit per row that takes probability mass
    and adds no value (added to the weight sum after the scan). Returns [N, R, D]
    in ``q``'s dtype (float32 math)."""
    n, r, d = q.shape
    s = k.shape[1]
    splits = s // KV_SPLIT
    scores = torch.bmm(q, k.transpose(1, 2)).mul_(scale)                          # [N, R, S]
    if softcap is not None:
        scores.div_(softcap).tanh_().mul_(softcap)
    scores.masked_fill_(masked_out, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)                                       # exact
    if sinks is not None:
        top = torch.maximum(top, sinks)
    probs = torch.exp_(scores.sub_(top))                                          # [N, R, S]
    # [N, R, splits, C]: each split's weight sum over exactly C keys, then a scan
    sums = probs.view(n, r, splits, KV_SPLIT).sum(dim=-1)                        # [N, R, splits]
    sums = sums.cumsum(dim=-1)[..., -1:] if splits > 1 else sums                  # [N, R, 1]
    pv = probs.view(n, r, splits, KV_SPLIT).transpose(1, 2).reshape(n * splits, r, KV_SPLIT)
    vs = v.reshape(n * splits, KV_SPLIT, d)
    parts = torch.bmm(pv, vs).view(n, splits, r, d)                               # per split
    out = parts.cumsum(dim=1)[:, -1] if splits > 1 else parts[:, 0]               # [N, R, D]
    if sinks is not None:
        sums = sums + torch.exp(sinks - top)
    return out.div_(sums).to(q.dtype)


def _gather(cache: torch.Tensor, table: torch.Tensor, width: int) -> torch.Tensor:
    """Keys or values of the blocks ``table`` [NB] (or [B, NB]) as [..., width, Hkv, D]:
    past the blocks, block 0's (finite: every key there is masked, its weight an
    exact 0) when whole blocks fill the width, else zeros."""
    bs, hkv, d = cache.shape[1:]
    short = width // bs - table.shape[-1]
    if width % bs == 0 and short > 0:  # (one copy instead of a copy and a concatenation)
        table = torch.nn.functional.pad(table, (0, short))
    got = cache.index_select(0, table.reshape(-1)).view(*table.shape[:-1], -1, hkv, d)
    have = got.shape[-3]
    if have < width:
        pad = got.new_zeros(*got.shape[:-3], width - have, hkv, d)
        got = torch.cat([got, pad], dim=-3)
    return got[..., :width, :, :]


def decode_width(block_tables: torch.Tensor, block_size: int) -> int:
    """Keys a decode row of :func:`invariant_decode_attention` spans (padded to the split)."""
    return _round_up(block_tables.shape[1] * block_size, KV_SPLIT)


def decode_masked_keys(context_lens: torch.Tensor, kv_heads: int, width: int,
                       window: int | None = None) -> torch.Tensor:
    """``[B * Hkv, 1, width]`` bool: :func:`masked_keys` of decode rows, per (row, kv head)."""
    return masked_keys(context_lens.repeat_interleave(kv_heads), width, window).unsqueeze(1)


def invariant_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float, *, masked_out: torch.Tensor | None = None,
                               window: int | None = None, softcap: float | None = None
                               ) -> torch.Tensor:
    """Decode rows: ``q`` [B, H, D], each row over its first ``context_lens[b]``
    tokens in ``block_tables[b]`` [B, NB]. Returns [B, H, D]. ``masked_out``:
    :func:`decode_masked_keys`, when the caller made it once for many layers;
    ``window``, ``softcap``: as :func:`formcast.engine.kernels.paged_attention.paged_attention`'s."""
    b, h, d = q.shape
    hkv = k_cache.shape[2]
    g = h // hkv
    rows = _round_up(g, ROW_TILE)
    width = decode_width(block_tables, k_cache.shape[1])
    kk = _gather(k_cache, block_tables, width).permute(0, 2, 1, 3).reshape(b * hkv, width, d)
    vv = _gather(v_cache, block_tables, width).permute(0, 2, 1, 3).reshape(b * hkv, width, d)
    qq = F.pad(q.view(b, hkv, g, d), (0, 0, 0, rows - g))  # (zero rows up to the tile)
    if masked_out is None:
        masked_out = decode_masked_keys(context_lens, hkv, width, window)
    out = attend_split(qq.view(b * hkv, rows, d), kk, vv, masked_out, scale, softcap)
    return out.view(b, hkv, rows, d)[:, :, :g].reshape(b, h, d)


def prefill_masked_keys(lengths: list[int], context_lens: list[int], group: int,
                        window: int | None, device: torch.device) -> list[torch.Tensor]:
    """Per prompt chunk, ``[1, R, S]`` bool: :func:`masked_keys` of its query rows
    (``group`` query heads a kv head, token-major, padded to the row tile; padding
    rows see key 0), made once a step for every layer of ``window``."""
    out = []
    for length, context in zip(lengths, context_lens):
        rows = _round_up(length * group, ROW_TILE)
        limits = torch.ones(rows, dtype=torch.long, device=device)
        limits[:length * group] = torch.arange(context - length + 1, context + 1,
                                               device=device).repeat_interleave(group)
        out.append(masked_keys(limits, _round_up(context, KV_SPLIT), window).unsqueeze(0))
    return out


def invariant_prefill_attention_(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                                 v_cache: torch.Tensor, starts: list[int], lengths: list[int],
                                 context_lens: list[int], block_tables: list[torch.Tensor],
                                 scale: float, *, window: int | None = None,
                                 softcap: float | None = None,
                                 masks: list[torch.Tensor] | None = None) -> None:
    """Prompt chunks (arguments as
    :func:`formcast.engine.kernels.paged_attention.paged_prefill_attention_`), causal,
    every row as a decode row at its position would be; written into ``out``.
    ``masks``: :func:`prefill_masked_keys` of the chunks, when the caller made them
    once for many layers."""
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    h = q.shape[1]
    g = h // hkv
    if masks is None:
        masks = prefill_masked_keys(lengths, context_lens, g, window, q.device)
    for start, length, context, table, masked in zip(starts, lengths, context_lens,
                                                     block_tables, masks):
        width = _round_up(context, KV_SPLIT)
        kk = _gather(k_cache, table, width).permute(1, 0, 2).contiguous()      # [Hkv, S, D]
        vv = _gather(v_cache, table, width).permute(1, 0, 2).contiguous()
        rows = _round_up(length * g, ROW_TILE)
        # [Hkv, L * G, D]: a kv head's query rows, token-major
        qq = F.pad(q[start:start + length].view(length, hkv, g, d).permute(1, 0, 2, 3)
                   .reshape(hkv, length * g, d), (0, 0, 0, rows - length * g))
        o = attend_split(qq, kk, vv, masked, scale, softcap)                  # [Hkv, R, D]
        out[start:start + length] = o[:, :length * g].view(hkv, length, g, d) \
            .permute(1, 0, 2, 3).reshape(length, h, d)
