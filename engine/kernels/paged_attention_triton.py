"""Triton paged attention for CUDA: decode rows, and causal prefill chunks.

One program per (row, key/value head): the group of query heads sharing that
key/value head (padded to 16 rows for ``tl.dot``) walks the row's context
``BLOCK_N`` tokens at a time, loading each token's key and value straight from
its cache block, with an online softmax in float32. With few rows (batch 1 has
only Hkv programs) the context is split over ``SPLITS`` programs whose partial
results are merged by a second small kernel (flash-decoding); with enough rows
for one split, the kernel writes the output itself.

Prefill: one program per (chunk, tile of ``BLOCK_M`` queries, query head), over
the chunk's keys up to the tile's last position (causal), read from the cache
blocks the same way; all chunks of a step in one launch.

A sliding ``window`` (0: none) starts each query's keys at its position minus
``window - 1``: the loops begin there, no tile before it is read. ``softcap``
(0: none) caps the scaled scores at ``c * tanh(s / c)`` before the mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from formcast.engine.kernels.paged_attention import SPLIT_BELOW
from formcast.engine.kernels.rmsnorm_triton import row_inverse_rms


@triton.jit
def _attend_tile(q, acc, mx, total, k_ptr, v_ptr, table_ptr, offs, live, seen, kvh, d, live_d,
                 scale, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                 BLOCK_SIZE: tl.constexpr, IEEE: tl.constexpr, softcap=0.0,
                 SOFTCAP: tl.constexpr = False):
    """One tile of keys (context positions ``offs``, ``live`` inside the range, the
    queries × keys mask ``seen``) folded into a running online softmax: returns
    the new (acc, running max, running sum). Keys and values are read straight
    from the cache blocks that ``table_ptr`` lists."""
    block = tl.load(table_ptr + offs // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
    within = (offs % BLOCK_SIZE).to(tl.int64)
    kmask = live[:, None] & live_d[None, :]
    k = tl.load(k_ptr + block[:, None] * stride_kb + within[:, None] * stride_kt
                + kvh * stride_kh + d[None, :], mask=kmask, other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * scale
    if SOFTCAP:  # c tanh(s / c) = c (1 - 2 / (exp(2 s / c) + 1))
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
    s = tl.where(seen, s, float("-inf"))                                # [M, N]
    m_new = tl.maximum(mx, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)              # rows with nothing yet
    alpha = tl.exp(mx - m_safe)
    p = tl.exp(s - m_safe[:, None])
    total = total * alpha + tl.sum(p, axis=1)
    v = tl.load(v_ptr + block[:, None] * stride_vb + within[:, None] * stride_vt
                + kvh * stride_vh + d[None, :], mask=kmask, other=0.0)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return acc * alpha[:, None] + pv, m_new, total


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, lse_ptr, scale,
                   group, head_dim, stride_qb, stride_qh, stride_kb, stride_kt, stride_kh,
                   stride_vb, stride_vt, stride_vh, stride_tb, window, softcap,
                   BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr,
                   SOFTCAP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    length = tl.load(lens_ptr + row).to(tl.int32)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    live_g = g < group
    live_d = d < head_dim
    heads = kvh * group + g
    q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=live_g[:, None] & live_d[None, :], other=0.0)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    # this split's share of the row's context (from its window's start), in whole
    # BLOCK_N tiles
    lo = tl.maximum(length - window, 0)
    split_len = tl.cdiv(tl.cdiv(length - lo, SPLITS), BLOCK_N) * BLOCK_N
    begin = lo + split * split_len
    end = tl.minimum(begin + split_len, length)
    for start in range(begin, end, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        live = offs < end
        acc, m, total = _attend_tile(q, acc, m, total, k_ptr, v_ptr, tables_ptr + row * stride_tb,
                                     offs, live, live[None, :], kvh, d, live_d, scale,
                                     stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                                     stride_vh, BLOCK_SIZE, IEEE, softcap, SOFTCAP)
    # an empty split (its range starts past the context) leaves total 0: lse -inf
    out = acc / tl.maximum(total, 1e-30)[:, None]
    lse = m + tl.log(total)
    base = (row * tl.num_programs(1) * group + heads) * SPLITS + split        # [G]
    tl.store(out_ptr + base[:, None] * head_dim + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=live_g[:, None] & live_d[None, :])
    if SPLITS > 1:  # one split writes the output itself: nothing to merge
        tl.store(lse_ptr + base, lse, mask=live_g)


@triton.jit
def _merge_kernel(part_ptr, lse_ptr, out_ptr, head_dim, SPLITS: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    rh = tl.program_id(0).to(tl.int64)          # row * H + head
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(lse_ptr + rh * SPLITS + s)
    top = tl.max(lse, axis=0)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - top))
    part = tl.load(part_ptr + (rh * SPLITS + s)[:, None] * head_dim + d[None, :],
                   mask=d[None, :] < head_dim, other=0.0)
    out = tl.sum(part * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + rh * head_dim + d, out.to(out_ptr.dtype.element_ty), mask=d < head_dim)


def num_splits(rows: int, kv_heads: int, max_len: int, block_n: int) -> int:
    """Splits of the context per (row, kv head): enough programs to fill the GPU's
    multiprocessors at small batches, none past the longest context (fixed per
    call, so a captured graph keeps its grid); none from ``SPLIT_BELOW`` programs."""
    programs = rows * kv_heads
    splits = 1
    while programs * splits < SPLIT_BELOW and splits * block_n < max_len and splits < 32:
        splits *= 2
    return splits


SPLIT_BLOCK_N = 64  # keys a tile when contexts are split (the split count counts those)


def decode_splits(rows: int, k_cache: torch.Tensor, block_tables: torch.Tensor) -> int:
    """The splits the decode kernel runs for ``rows`` rows over these tables
    (:func:`num_splits` for the cache's kv heads and the tables' longest context)."""
    return num_splits(rows, k_cache.shape[2], block_tables.shape[1] * k_cache.shape[1],
                      SPLIT_BLOCK_N)


FEW_PROGRAMS = 512  # below this many (row, kv head) programs: one tile covers most contexts


def decode_config(splits: int, dtype: torch.dtype, programs: int) -> tuple[int, int, int]:
    """Keys a tile, warps and stages of the decode kernel for ``programs``
    (row, kv head) programs.

    Chosen by ``benchmarks/decode_attention_configs.py`` (each configuration in
    a CUDA graph over a model's layers' caches, checked against the torch path;
    figures in docs/performance.md): up to 128 rows a tile of 128 keys over four
    warps and three stages takes most contexts in one pass; at 256 rows tiles of
    64 keys, two warps and three stages. Float32 keeps tiles of 64, two warps,
    three stages. Split contexts: tiles of 64, four warps and two stages.
"""
    if splits > 1:
        return SPLIT_BLOCK_N, 4, 2
    if dtype == torch.float32 or programs >= FEW_PROGRAMS:
        return 64, 2, 3
    return 128, 4, 3


def launch_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, context_lens: torch.Tensor, part: torch.Tensor,
                  lse: torch.Tensor, scale: float, splits: int,
                  config: tuple[int, int, int], *, window: int | None = None,
                  softcap: float | None = None) -> None:
    """One launch of the decode kernel: ``part`` (and ``lse``) take each split's
    output; with one split ``part`` is the ``[B, H, D]`` output itself.
    ``config``: keys a tile, warps, stages (:func:`decode_config`)."""
    b, h, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    block_n, warps, stages = config
    _decode_kernel[(b, hkv, splits)](
        q, k_cache, v_cache, block_tables, context_lens, part, lse, scale,
        h // hkv, d, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), _window_arg(window), float(softcap or 0.0),
        BLOCK_SIZE=block_size, BLOCK_G=max(16, triton.next_power_of_2(h // hkv)),
        BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(d)), SPLITS=splits,
        IEEE=q.dtype == torch.float32, SOFTCAP=softcap is not None, num_warps=warps,
        num_stages=stages)


def _window_arg(window: int | None) -> int:
    """A kernel's window argument: keys a query sees at most (no window: more than
    any context holds)."""
    return window if window is not None else 2 ** 30


def paged_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor,
                                  scale: float, *, window: int | None = None,
                                  softcap: float | None = None) -> torch.Tensor:
    b, h, d = q.shape
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged attention: the head dimension must be contiguous")
    splits = decode_splits(b, k_cache, block_tables)
    if splits == 1:  # the kernel writes the output: no partial results to merge
        part = lse = torch.empty(b, h, d, dtype=q.dtype, device=q.device)
    else:
        part = torch.empty(b, h, splits, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(b, h, splits, dtype=torch.float32, device=q.device)
    launch_decode(q, k_cache, v_cache, block_tables, context_lens, part, lse, scale, splits,
                  decode_config(splits, q.dtype, b * k_cache.shape[2]), window=window,
                  softcap=softcap)
    if splits == 1:
        return part
    out = torch.empty(b, h, d, dtype=q.dtype, device=q.device)
    _merge_kernel[(b * h,)](part, lse, out, d, SPLITS=splits,
                            BLOCK_D=triton.next_power_of_2(d))
    return out


INVARIANT_CONFIG = (64, 4, 3)  # keys a tile, warps, stages: the same for every batch


def invariant_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor,
                                      v_cache: torch.Tensor, block_tables: torch.Tensor,
                                      context_lens: torch.Tensor, scale: float, *,
                                      window: int | None = None,
                                      softcap: float | None = None) -> torch.Tensor:
    """Batch-invariant decode attention: one program per (row, kv head) over its
    whole context, tiles of 64 keys from position 0 in order (no split chosen by
    the batch, one configuration for every batch). Prompt rows go through it too,
    each as a decode row at its position, so a token gets the same bits in a
    prompt chunk or a decode step. Arguments as :func:`paged_decode_attention_triton`."""
    b, h, d = q.shape
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged attention: the head dimension must be contiguous")
    out = torch.empty(b, h, d, dtype=q.dtype, device=q.device)
    if b:
        launch_decode(q, k_cache, v_cache, block_tables, context_lens, out, out, scale, 1,
                      INVARIANT_CONFIG, window=window, softcap=softcap)
    return out


@triton.jit
def _rope_decode_kernel(qkv_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, tables_ptr,
                        lens_ptr, out_ptr, lse_ptr, s_ptr, scale, group, num_q, head_dim,
                        stride_t, stride_h, table_stride, stride_kb, stride_kt, stride_kh,
                        stride_vb, stride_vt, stride_vh, stride_tb, stride_s, n_s, eps, window,
                        BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr,
                        HAS_SCALE: tl.constexpr, BLOCK_E: tl.constexpr):
    """A decode row's attention with its new token's rotation and cache store:
    the query heads of kv head ``kvh`` and that head's new key rotate at the
    row's position (rounded to the activations' dtype, as the rotation kernel
    rounds; each element's partner in the other half read alongside it), split
    0 writes the key and value to the row's cache slot and, after the cached
    context (its first ``length - 1`` tokens, walked as :func:`_decode_kernel`
    walks a context), adds the new token to the online softmax (its scores
    found before the loop, its value read again after it: the loop keeps
    fewer registers live). ``HAS_SCALE``: the row's projections are first
    scaled by the inverse root mean square of row ``row`` of ``s_ptr`` and
    rounded to the dtype (a norm's weight folded into the projection)."""
    row = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    length = tl.load(lens_ptr + row).to(tl.int32)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    live_g = g < group
    live_d = d < head_dim
    half = head_dim // 2
    partner = tl.where(d < half, d + half, d - half)
    sign = tl.where(d < half, -1.0, 1.0)            # rotate-half: [x1 c - x2 s, x2 c + x1 s]
    cs = tl.load(cos_ptr + pos * table_stride + d, mask=live_d, other=0.0)
    sn = tl.load(sin_ptr + pos * table_stride + d, mask=live_d, other=0.0) * sign
    dtype = qkv_ptr.dtype.element_ty
    base = qkv_ptr + row * stride_t
    heads = kvh * group + g
    qmask = live_g[:, None] & live_d[None, :]
    at_q = base + heads[:, None] * stride_h
    x = tl.load(at_q + d[None, :], mask=qmask, other=0.0).to(tl.float32)
    y = tl.load(at_q + partner[None, :], mask=qmask, other=0.0).to(tl.float32)
    at_k = base + (num_q + kvh) * stride_h
    at_v = base + (num_q + tl.num_programs(1) + kvh) * stride_h
    kx = tl.load(at_k + d, mask=live_d, other=0.0).to(tl.float32)
    ky = tl.load(at_k + partner, mask=live_d, other=0.0).to(tl.float32)
    r = 1.0
    if HAS_SCALE:
        r = row_inverse_rms(s_ptr + row * stride_s, n_s, eps, BLOCK_E)
        x = (x * r).to(dtype).to(tl.float32)
        y = (y * r).to(dtype).to(tl.float32)
        kx = (kx * r).to(dtype).to(tl.float32)
        ky = (ky * r).to(dtype).to(tl.float32)
    q = tl.fma(x, cs[None, :], y * sn[None, :]).to(dtype)  # (as _rope_kernel rounds)
    k_new = tl.fma(kx, cs, ky * sn).to(k_ptr.dtype.element_ty)
    # the new token's scores now (the loop then holds a number a query head)
    s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale
    if split == 0:
        v_new = tl.load(at_v + d, mask=live_d, other=0.0)
        if HAS_SCALE:
            v_new = (v_new.to(tl.float32) * r).to(dtype)
        slot = tl.load(slot_ptr + row).to(tl.int64)
        tl.store(k_ptr + (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_kt
                 + kvh * stride_kh + d, k_new, mask=live_d)
        tl.store(v_ptr + (slot // BLOCK_SIZE) * stride_vb + (slot % BLOCK_SIZE) * stride_vt
                 + kvh * stride_vh + d, v_new.to(v_ptr.dtype.element_ty), mask=live_d)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    cached = length - 1
    lo = tl.maximum(length - window, 0)  # (the window's first key; the new token is its last)
    split_len = tl.cdiv(tl.cdiv(cached - lo, SPLITS), BLOCK_N) * BLOCK_N
    begin = lo + split * split_len
    end = tl.minimum(begin + split_len, cached)
    for start in range(begin, end, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        live = offs < end
        acc, m, total = _attend_tile(q, acc, m, total, k_ptr, v_ptr, tables_ptr + row * stride_tb,
                                     offs, live, live[None, :], kvh, d, live_d, scale,
                                     stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                                     stride_vh, BLOCK_SIZE, IEEE)
    if split == 0:  # the new token (its value read again: not held through the loop)
        v_new = tl.load(at_v + d, mask=live_d, other=0.0)
        if HAS_SCALE:
            v_new = (v_new.to(tl.float32) * r).to(dtype)
        m_new = tl.maximum(m, s_new)
        alpha = tl.exp(m - m_new)
        p = tl.exp(s_new - m_new)
        total = total * alpha + p
        pr = p.to(v_new.dtype).to(tl.float32)  # (rounded as the tiles' probabilities are)
        acc = acc * alpha[:, None] + pr[:, None] * v_new.to(tl.float32)[None, :]
        m = m_new
    out = acc / tl.maximum(total, 1e-30)[:, None]
    at = (row * tl.num_programs(1) * group + heads) * SPLITS + split          # [G]
    tl.store(out_ptr + at[:, None] * head_dim + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=qmask)
    if SPLITS > 1:
        tl.store(lse_ptr + at, m + tl.log(total), mask=live_g)


def rope_decode_attention_triton(qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
                                 positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                 k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 slots: torch.Tensor, block_tables: torch.Tensor,
                                 context_lens: torch.Tensor, scale: float, *,
                                 scale_by: torch.Tensor | None = None, eps: float = 0.0,
                                 config: tuple[int, int, int] | None = None,
                                 window: int | None = None, invariant: bool = False
                                 ) -> torch.Tensor:
    """Decode rows' attention from their fused projection's output ``qkv``
    ``[B, (H + 2 Hkv) * D]`` (queries, keys, values; rows contiguous), each at
    ``positions`` with the new token's key and value written to ``slots`` of
    the caches on the way: what :func:`formcast.engine.kernels.rope.
    apply_rope_and_store_kv_` then :func:`paged_decode_attention_triton` do,
    in one launch (two with a split context). ``context_lens`` count the new
    token. Returns ``[B, H, D]``; ``qkv`` is left as it is. ``config`` (keys a
    tile, warps, stages) replaces :func:`decode_config`'s choice (for
    benchmarks/decode_attention_configs.py). ``scale_by`` [B, E], ``eps``: see
    :func:`formcast.engine.kernels.paged_attention.rope_decode_attention`.
    ``invariant``: one program a (row, kv head) over its whole context and
    :data:`INVARIANT_CONFIG`, whatever the batch (batch-invariant mode)."""
    b = qkv.shape[0]
    d = k_cache.shape[3]
    h, hkv = num_heads, num_kv_heads
    if qkv.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged attention: the head dimension must be contiguous")
    if d % 2:
        raise ValueError(f"rope: an odd head dimension ({d}) has no halves to rotate")
    if k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype:
        raise ValueError(f"rope decode attention: caches of {k_cache.dtype} for activations "
                         f"of {qkv.dtype}")
    splits = 1 if invariant else decode_splits(b, k_cache, block_tables)
    if invariant:
        config = INVARIANT_CONFIG
    if splits == 1:
        part = lse = torch.empty(b, h, d, dtype=qkv.dtype, device=qkv.device)
    else:
        part = torch.empty(b, h, splits, d, dtype=torch.float32, device=qkv.device)
        lse = torch.empty(b, h, splits, dtype=torch.float32, device=qkv.device)
    block_n, warps, stages = config or decode_config(splits, qkv.dtype, b * hkv)
    cos = cos.to(device=qkv.device, dtype=torch.float32)
    sin = sin.to(device=qkv.device, dtype=torch.float32)
    s = qkv if scale_by is None else scale_by
    if s.stride(-1) != 1:
        s = s.contiguous()
    _rope_decode_kernel[(b, hkv, splits)](
        qkv, positions, slots, cos, sin, k_cache, v_cache, block_tables, context_lens, part,
        lse, s, scale, h // hkv, h, d, qkv.stride(0), d, cos.stride(0), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), block_tables.stride(0), s.stride(0), s.shape[1], eps,
        _window_arg(window), BLOCK_SIZE=k_cache.shape[1], BLOCK_G=max(16, triton.next_power_of_2(h // hkv)),
        BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(d)), SPLITS=splits,
        IEEE=qkv.dtype == torch.float32, HAS_SCALE=scale_by is not None,
        BLOCK_E=triton.next_power_of_2(s.shape[1]) if scale_by is not None else 16,
        num_warps=warps, num_stages=stages)
    if splits == 1:
        return part
    out = torch.empty(b, h, d, dtype=qkv.dtype, device=qkv.device)
    _merge_kernel[(b * h,)](part, lse, out, d, SPLITS=splits, BLOCK_D=triton.next_power_of_2(d))
    return out


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, starts_ptr, lens_ptr, ctx_ptr, tables_ptr,
                    scale, group, head_dim, stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_tb,
                    window, softcap,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr):
    chunk = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    head = tl.program_id(2).to(tl.int64)
    kvh = head // group
    length = tl.load(lens_ptr + chunk).to(tl.int32)
    context = tl.load(ctx_ptr + chunk).to(tl.int32)
    start = tl.load(starts_ptr + chunk).to(tl.int64)
    offset = context - length                      # position of the chunk's first query
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    live_m = m < length
    d = tl.arange(0, BLOCK_D)
    live_d = d < head_dim
    rows = start + m.to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=live_m[:, None] & live_d[None, :], other=0.0)
    qpos = offset + m
    # keys up to the tile's last query (causal); none for a tile past the chunk
    end = tl.minimum(context, offset + (tile + 1) * BLOCK_M)
    end = tl.where(tile * BLOCK_M < length, end, 0)
    mx = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # keys from the window's start of the tile's first query
    lo = tl.maximum(offset + tile * BLOCK_M - window + 1, 0)
    for n0 in range(lo, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        live_n = offs < end
        seen = live_n[None, :] & (offs[None, :] <= qpos[:, None]) & \
            (offs[None, :] > qpos[:, None] - window)
        acc, mx, total = _attend_tile(q, acc, mx, total, k_ptr, v_ptr,
                                      tables_ptr + chunk * stride_tb, offs, live_n, seen, kvh,
                                      d, live_d, scale, stride_kb, stride_kt, stride_kh,
                                      stride_vb, stride_vt, stride_vh, BLOCK_SIZE, IEEE,
                                      softcap, SOFTCAP)
    o = acc / tl.maximum(total, 1e-30)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=live_m[:, None] & live_d[None, :])


def paged_prefill_attention_triton_(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                                    v_cache: torch.Tensor, meta: torch.Tensor,
                                    tables: torch.Tensor, scale: float, *, max_length: int,
                                    window: int | None = None, softcap: float | None = None
                                    ) -> None:
    """``meta`` [3, P] (starts, lengths, context lengths) and ``tables`` [P, NB] on
    the device (:func:`formcast.engine.kernels.paged_attention.pack_prefills`);
    ``max_length``: the longest chunk, which sizes the grid; ``window``,
    ``softcap``: see the module doc (None: none)."""
    h, d = q.shape[1], q.shape[2]
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    if q.stride(-1) != 1 or out.stride(-1) != 1 or k_cache.stride(-1) != 1 \
            or v_cache.stride(-1) != 1:
        raise ValueError("paged attention: the head dimension must be contiguous")
    block_m = 64 if max_length > 32 else 16
    grid = (meta.shape[1], triton.cdiv(max_length, block_m), h)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, meta[0], meta[1], meta[2], tables, scale, h // hkv, d,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), tables.stride(0), _window_arg(window), float(softcap or 0.0),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=64,
        BLOCK_D=max(16, triton.next_power_of_2(d)), IEEE=q.dtype == torch.float32,
        SOFTCAP=softcap is not None)
