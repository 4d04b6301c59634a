"""Attention over the paged KV cache: decode rows (one query token each) and
prefill chunks (many query tokens of one sequence, causal).

Row ``b`` attends to the first ``context_lens[b]`` tokens of its sequence (with a
sliding ``window``: the last ``window`` of them, its own included), whose
keys/values sit in the cache blocks ``block_tables[b]`` (token ``j`` in block
``block_tables[b, j // BS]``, slot ``j % BS``). Query heads share key/value heads
in groups (GQA). The torch path is the reference and the CPU's: it gathers the
blocks and runs two batched GEMMs, each row bit-identical to its one-row result.
Triton runs on CUDA tensors: it reads the blocks in place (no gather), with an
online softmax, and takes its loop bounds from device memory, so a CUDA graph
replays it for any context lengths.

Shapes: B rows, H query heads, Hkv key/value heads, D head dim, NBtotal cache
blocks, BS block size, NB blocks a row (padded; entries past a row's context are
never read), S = NB * BS.

``softcap`` c (Gemma 2 style): scores become ``c * tanh(score / c)`` after the
scale, before the mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from formcast.engine.kernels import to_device, use_triton

# the Triton decode kernels split each (row, kv head)'s context below this many
# such programs (kernels.paged_attention_triton.num_splits)
SPLIT_BELOW = 128


def decode_masked_out(context_lens: torch.Tensor, width: int, window: int | None = None
                      ) -> torch.Tensor:
    """``[B, 1, 1, width]`` bool, True at key positions past each row's context
    (and, with ``window``, before its last ``window`` tokens)."""
    cols = torch.arange(width, device=context_lens.device)
    lens = context_lens.view(-1, 1)
    out = cols >= lens
    if window is not None:
        out |= cols < lens - window
    return out.view(-1, 1, 1, width)


def _softcap_(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap * tanh(scores / softcap)`` in place (nothing without a cap)."""
    if softcap is None:
        return scores
    return scores.div_(softcap).tanh_().mul_(softcap)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           *, masked_out: torch.Tensor | None = None,
                           window: int | None = None, softcap: float | None = None,
                           backend: str = "auto") -> torch.Tensor:
    """Attention of ``q`` [B, H, D] over the cache ([NBtotal, BS, Hkv, D] each);
    ``block_tables`` [B, NB] and ``context_lens`` [B] integer. Returns [B, H, D] in
    ``q``'s dtype. ``masked_out``: :func:`decode_masked_out` of the lengths (and
    ``window``), when the caller made it once for many layers (torch path only)."""
    b, h, d = q.shape
    hkv = k_cache.shape[2]
    if h % hkv:
        raise ValueError(f"paged attention: {h} query heads do not group over {hkv} kv heads")
    if b == 0:
        return q.new_empty(0, h, d)
    if use_triton(q, backend):
        from formcast.engine.kernels.paged_attention_triton import paged_decode_attention_triton

        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens,
                                             scale, window=window, softcap=softcap)
    width = block_tables.shape[1] * k_cache.shape[1]
    if masked_out is None:
        masked_out = decode_masked_out(context_lens, width, window)
    # K made contiguous: the score GEMM then takes the same kernel whatever B is
    # (on a strided K, MKL's choice depends on the batch and rows stop matching
    # their own one-row result), and it is faster
    # (index_select: the same copy as k_cache[block_tables], several times faster on a CPU)
    flat = block_tables.reshape(-1)
    kk = k_cache.index_select(0, flat).view(b, -1, hkv, d).transpose(1, 2).contiguous()  # [B,Hkv,S,D]
    vv = v_cache.index_select(0, flat).view(b, -1, hkv, d).transpose(1, 2)
    qq = q.reshape(b, hkv, h // hkv, d)                                            # [B,Hkv,G,D]
    scores = torch.matmul(qq, kk.transpose(-1, -2)).mul_(scale)                   # [B,Hkv,G,S]
    _softcap_(scores, softcap).masked_fill_(masked_out, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, vv).view(b, h, d)


def rope_decode_attention(qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
                          positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                          block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                          *, scale_by: torch.Tensor | None = None, eps: float = 0.0,
                          window: int | None = None, backend: str = "auto") -> torch.Tensor:
    """Decode rows' attention from their fused projection's output, its new
    token's rotation and cache store included: ``qkv`` ``[B, (H + 2 Hkv) * D]``
    (query heads, key heads, value heads) at ``positions`` [B] (the float32
    ``cos``/``sin`` tables [P, D] of :mod:`formcast.engine.kernels.rope`); the
    rotated keys and the values go to ``slots`` [B] of the caches, then each
    row attends to its first ``context_lens[b]`` tokens (the new one counted).
    Returns ``[B, H, D]`` in ``qkv``'s dtype and leaves ``qkv`` as it is. The
    torch path (the reference) rotates a copy, stores, then runs
    :func:`paged_decode_attention`; on CUDA one Triton kernel does all three.
    ``scale_by`` [B, E] (with ``eps``): each row of ``qkv`` is first scaled by the
    inverse root mean square of that row of ``scale_by`` and rounded to the
    dtype: the projection's input norm, its weight folded into the projection
    (see :func:`formcast.engine.kernels.activation.silu_and_mul`)."""
    from formcast.engine.kernels.rmsnorm import scale_rows
    from formcast.engine.kernels.rope import apply_rope_, store_kv_

    b, d = qkv.shape[0], k_cache.shape[3]
    h, hkv = num_heads, num_kv_heads
    if h % hkv:
        raise ValueError(f"paged attention: {h} query heads do not group over {hkv} kv heads")
    if qkv.shape[1] != (h + 2 * hkv) * d:
        raise ValueError(f"rope decode attention: {qkv.shape[1]} columns for {h} + 2 x {hkv} "
                         f"heads of {d}")
    if scale_by is not None and scale_by.shape[0] != b:
        raise ValueError(f"rope decode attention: {scale_by.shape[0]} rows to scale by for "
                         f"{b} rows")
    if b == 0:
        return qkv.new_empty(0, h, d)
    if use_triton(qkv, backend):
        from formcast.engine.kernels.paged_attention_triton import rope_decode_attention_triton

        return rope_decode_attention_triton(qkv, h, hkv, positions, cos, sin, k_cache, v_cache,
                                            slots, block_tables, context_lens, scale,
                                            scale_by=scale_by, eps=eps, window=window)
    if scale_by is not None:
        qkv = scale_rows(qkv, scale_by, eps)
    qk = qkv[:, :(h + hkv) * d].reshape(b, h + hkv, d).clone()
    apply_rope_(qk, positions, cos, sin, backend="torch")
    store_kv_(k_cache, v_cache, qk[:, h:], qkv[:, (h + hkv) * d:].reshape(b, hkv, d), slots)
    return paged_decode_attention(qk[:, :h], k_cache, v_cache, block_tables, context_lens, scale,
                                  window=window, backend="torch")


def pack_prefills(starts: list[int], lengths: list[int], context_lens: list[int],
                  block_tables: list, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill chunks as two ``device`` tensors, each moved in one copy: (starts,
    lengths, context lengths) [3, P] long, and the block tables (lists or 1-D
    tensors) [P, NB] long, padded with block 0."""
    rows = [t.tolist() if isinstance(t, torch.Tensor) else list(t) for t in block_tables]
    width = max(map(len, rows))
    return (to_device([starts, lengths, context_lens], torch.long, device),
            to_device([r + [0] * (width - len(r)) for r in rows], torch.long, device))


def paged_prefill_attention_(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, starts: list[int], lengths: list[int],
                             context_lens: list[int], block_tables: list[torch.Tensor],
                             scale: float, *, k: torch.Tensor | None = None,
                             v: torch.Tensor | None = None,
                             packed: tuple[torch.Tensor, torch.Tensor] | None = None,
                             window: int | None = None, softcap: float | None = None,
                             backend: str = "auto") -> None:
    """Causal attention of prefill chunks, written into ``out`` [T, H, D] in place.

    Chunk ``i`` is rows ``starts[i] : starts[i] + lengths[i]`` of ``q`` [T, H, D]: the
    last ``lengths[i]`` of its sequence's ``context_lens[i]`` tokens, whose keys and
    values (this chunk's included) are in the cache blocks ``block_tables[i]`` [NB].
    ``k``, ``v`` [T, Hkv, D]: this step's keys/values, which the torch path reads
    directly for a chunk with nothing cached before it. ``packed``: the same
    chunks as (starts, lengths, context lengths) [3, P] and padded block tables
    [P, NB], on the device already (the Triton path then moves nothing).
    """
    if not starts:
        return
    if use_triton(q, backend):
        from formcast.engine.kernels.paged_attention_triton import paged_prefill_attention_triton_

        if packed is None:
            packed = pack_prefills(starts, lengths, context_lens, block_tables, q.device)
        paged_prefill_attention_triton_(out, q, k_cache, v_cache, *packed, scale,
                                        max_length=max(lengths), window=window,
                                        softcap=softcap)
        return
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    for start, length, context, table in zip(starts, lengths, context_lens, block_tables):
        rows = slice(start, start + length)
        qs = q[rows].transpose(0, 1).unsqueeze(0)                       # [1, H, L, D]
        plain = window is None and softcap is None
        if context == length and k is not None:  # nothing cached before this chunk
            ks = k[rows].transpose(0, 1).unsqueeze(0)                    # [1, Hkv, L, D]
            vs = v[rows].transpose(0, 1).unsqueeze(0)
            if plain:
                out[rows] = F.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True
                ).squeeze(0).transpose(0, 1)
                continue
        else:
            ks = k_cache[table].view(-1, hkv, d)[:context].transpose(0, 1).unsqueeze(0)
            vs = v_cache[table].view(-1, hkv, d)[:context].transpose(0, 1).unsqueeze(0)
        qpos = torch.arange(length, device=q.device).unsqueeze(1) + (context - length)
        kpos = torch.arange(context, device=q.device).unsqueeze(0)
        mask = kpos <= qpos                                              # [L, S]
        if window is not None:
            mask &= kpos > qpos - window
        if softcap is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                               enable_gqa=True)
        else:
            o = _capped_attention(qs, ks, vs, mask, scale, softcap)
        out[rows] = o.squeeze(0).transpose(0, 1)


def _capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float, softcap: float) -> torch.Tensor:
    """Attention with soft-capped scores (SDPA has no cap): q [1, H, L, D], k, v
    [1, Hkv, S, D], ``mask`` [L, S] True where a query sees a key. Returns [1, H, L, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = _softcap_(torch.matmul(q, k.transpose(-1, -2)).mul_(scale), softcap)
    scores.masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)
