"""RMSNorm (+ residual), RoPE, paged decode/prefill attention, sampling and grouped
expert kernels: the torch reference against the model's
formulas, and the Triton kernels against the reference (on CUDA, and on the CPU
through Triton's interpreter in a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from formcast.engine.kernels.moe import grouped_expert_mlp
from formcast.engine.kernels.paged_attention import (paged_decode_attention,
                                                     paged_prefill_attention_,
                                                     rope_decode_attention)
from formcast.engine.kernels.sampling import sample, sampling_thresholds
from formcast.engine.kernels.rmsnorm import add_rms_norm, rms_norm, scale_rows
from formcast.engine.kernels.activation import silu_and_mul
from formcast.engine.kernels.rope import apply_rope_, apply_rope_and_store_kv_
from formcast.engine.layers.rotary import RotaryEmbedding


def _tables(device="cpu"):
    return RotaryEmbedding(64, 1024, 10000.0).tables(torch.device(device))


def test_reference_rms_norm_is_llamas_formula_and_the_fused_add_matches():
    gen = torch.Generator().manual_seed(0)
    x, a = torch.randn(4, 576, generator=gen), torch.randn(4, 576, generator=gen)
    w = torch.rand(576, generator=gen) + 0.5
    expected = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.equal(rms_norm(x, w, 1e-5), expected)
    for rows, width in ((1, 64), (3, 100), (17, 576), (2, 2048), (1, 7168)):  # fused op, bitwise
        xs, ws = torch.randn(rows, width, generator=gen), torch.rand(width, generator=gen) + 0.5
        assert torch.equal(rms_norm(xs, ws, 1e-6),
                           ws * (xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + 1e-6)))
    total, normed = add_rms_norm(x, a, w, 1e-5)
    assert torch.equal(total, x + a) and torch.equal(normed, rms_norm(x + a, w, 1e-5))
    with pytest.raises(ValueError, match="unknown backend"):
        rms_norm(x, w, 1e-5, backend="cuda")


def test_reference_row_scaling_is_a_weightless_norm_of_another_tensor():
    """``scale_by``: the gate and the fused attention scale each input row by the
    inverse RMS of a row of another tensor (a norm's, its weight folded into the
    projection before them), rounded to the dtype, before what they do."""
    from formcast.engine.kernels.rmsnorm import inverse_rms

    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        rows = (torch.randn(3, 576, generator=gen) * 4).to(dtype)
        factor = torch.rsqrt(rows.float().pow(2).mean(-1, keepdim=True) + 1e-5)
        assert torch.equal(inverse_rms(rows, 1e-5), factor)
        gu = torch.randn(3, 3072, generator=gen).to(dtype)
        assert torch.equal(silu_and_mul(gu, scale_by=rows, eps=1e-5),
                           silu_and_mul((gu.float() * factor).to(dtype)))
        h, hkv, d, bs = 9, 3, 64, 16
        k_cache, v_cache, tables = _paged_cache(gen, [5, 1, 40], hkv, d, bs, dtype)
        lens = torch.tensor([5, 1, 40])
        positions = lens - 1
        slots = torch.stack([tables[i, p // bs] * bs + p % bs
                             for i, p in enumerate(positions.tolist())])
        qkv = torch.randn(3, (h + 2 * hkv) * d, generator=gen).to(dtype)
        cos, sin = RotaryEmbedding(d, 4096, 10000.0).tables(torch.device("cpu"))
        outs = []
        for q, scale_by in ((qkv, rows), ((qkv.float() * factor).to(dtype), None)):
            kc, vc = k_cache.clone(), v_cache.clone()
            outs.append((rope_decode_attention(q, h, hkv, positions, cos, sin, kc, vc, slots,
                                               tables, lens, d ** -0.5, scale_by=scale_by,
                                               eps=1e-5), kc, vc))
        assert all(torch.equal(a, b) for a, b in zip(*outs))
    with pytest.raises(ValueError, match="rows to scale by"):
        silu_and_mul(gu, scale_by=rows[:2])
    with pytest.raises(ValueError, match="rows to scale by"):
        rope_decode_attention(qkv, h, hkv, positions, cos, sin, k_cache, v_cache, slots,
                              tables, lens, 0.125, scale_by=rows[:2])


def test_reference_sampling_keeps_the_right_tokens_and_draws_from_them():
    _compare_sampling("cpu", backends=("torch",))


def test_reference_rope_is_rotate_half_in_place():
    cos, sin = _tables()
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(6, 960, generator=gen)
    qk = qkv[:, :768].view(6, 12, 64)          # q|k of a fused projection, strided rows
    pos = torch.tensor([0, 1, 7, 300, 2, 1023])
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    rotate_half = torch.cat((-qk[..., 32:], qk[..., :32]), dim=-1)
    expected = qk * c + rotate_half * s         # transformers' formula
    v = qkv[:, 768:].clone()
    out = apply_rope_(qk, pos, cos, sin)
    assert out is qk and torch.equal(qk, expected)
    assert torch.equal(qkv[:, 768:], v)        # v untouched


def _compare(backend_device: str) -> None:
    """Triton vs torch on ``backend_device`` tensors (shared by the CUDA test and
    the interpreter subprocess)."""
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 0.07)):
        gen = torch.Generator().manual_seed(2)
        for rows, hidden in ((1, 576), (9, 576), (3, 960), (0, 576), (2, 4100)):
            x = torch.randn(rows, hidden, generator=gen).to(dtype).to(backend_device)
            a = torch.randn(rows, hidden, generator=gen).to(dtype).to(backend_device)
            w = (torch.rand(hidden, generator=gen) + 0.5).to(dtype).to(backend_device)
            ref, got = rms_norm(x, w, 1e-5, backend="torch"), rms_norm(x, w, 1e-5, backend="triton")
            assert got.dtype == ref.dtype and got.shape == ref.shape
            assert (got.float() - ref.float()).abs().max().item() <= tol * 4 if rows else True
            (s1, n1), (s2, n2) = (add_rms_norm(x, a, w, 1e-5, backend=b) for b in ("torch", "triton"))
            if rows:
                assert (s1.float() - s2.float()).abs().max().item() <= tol * 4
                assert (n1.float() - n2.float()).abs().max().item() <= tol * 4
        cos, sin = _tables(backend_device)
        qkv = torch.randn(7, 960, generator=gen).to(dtype).to(backend_device)
        pos = torch.tensor([0, 3, 9, 100, 5, 6, 1023]).to(backend_device)
        ref = apply_rope_(qkv[:, :768].clone().view(7, 12, 64), pos, cos, sin, backend="torch")
        got = qkv.clone()
        apply_rope_(got[:, :768].view(7, 12, 64), pos, cos, sin, backend="triton")
        assert (got[:, :768].view(7, 12, 64).float() - ref.float()).abs().max().item() <= tol
        assert torch.equal(got[:, 768:], qkv[:, 768:])
        # rotation fused with the stores of the new keys and values to the paged cache
        k_cache = torch.randn(6, 16, 3, 64, generator=gen).to(dtype).to(backend_device)
        v_cache = torch.randn(6, 16, 3, 64, generator=gen).to(dtype).to(backend_device)
        slots = torch.tensor([0, 17, 95, 40, 41, 3, 64]).to(backend_device)
        out = {}
        for backend in ("torch", "triton"):
            x, kc, vc = qkv.clone(), k_cache.clone(), v_cache.clone()
            apply_rope_and_store_kv_(x[:, :768].view(7, 12, 64), x[:, 768:].view(7, 3, 64),
                                     pos, cos, sin, kc, vc, slots, backend=backend)
            out[backend] = (x, kc, vc)
        for (a, b) in zip(out["torch"], out["triton"]):
            assert (a.float() - b.float()).abs().max().item() <= tol
        assert torch.equal(out["triton"][1].view(-1, 3, 64)[slots],
                           out["triton"][0][:, 576:768].view(7, 3, 64))   # rotated keys stored
        assert torch.equal(out["triton"][2].view(-1, 3, 64)[slots],
                           qkv[:, 768:].view(7, 3, 64))                   # values stored
        untouched = torch.ones(96, dtype=torch.bool)
        untouched[slots.cpu()] = False
        assert torch.equal(out["triton"][2].view(-1, 3, 64)[untouched.to(backend_device)],
                           v_cache.view(-1, 3, 64)[untouched.to(backend_device)])
        # silu(gate) * up, rounding where torch's two ops round
        for rows, width in ((1, 3072), (5, 100), (0, 64)):
            gu = torch.randn(rows, width, generator=gen).to(dtype).to(backend_device) * 3
            ref = silu_and_mul(gu, backend="torch")
            got = silu_and_mul(gu, backend="triton")
            assert got.shape == ref.shape and got.dtype == dtype
            rel = 2.0 ** -6 if dtype == torch.bfloat16 else 1e-5  # an ulp at each rounding
            assert torch.all((got.float() - ref.float()).abs() <= ref.float().abs() * rel + 1e-6)
            # each row scaled first by the inverse RMS of a row of another tensor
            scale_by = (torch.randn(rows, 576, generator=gen) * 2).to(dtype).to(backend_device)
            ref = silu_and_mul(gu, scale_by=scale_by, eps=1e-5, backend="torch")
            got = silu_and_mul(gu, scale_by=scale_by, eps=1e-5, backend="triton")
            assert got.shape == ref.shape and got.dtype == dtype
            # (the factors may differ in their last float32 bit, which can move each of
            # the four roundings by an ulp of the half type)
            rel = 2.0 ** -5 if dtype == torch.bfloat16 else 1e-5
            assert torch.all((got.float() - ref.float()).abs() <= ref.float().abs() * rel + 1e-6)


def _paged_cache(gen: torch.Generator, lens: list[int], hkv: int, d: int, bs: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random key and value caches of blocks of ``bs`` tokens (three spare blocks)
    and block tables giving each context of ``lens`` its own blocks, shuffled,
    each table padded two entries past the longest context."""
    nb_total = sum(-(-n // bs) for n in lens) + 3
    k_cache = torch.randn(nb_total, bs, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(nb_total, bs, hkv, d, generator=gen).to(dtype)
    free = torch.randperm(nb_total, generator=gen).tolist()
    width = max(-(-n // bs) for n in lens) + 2  # padding past every context
    tables = torch.zeros(len(lens), width, dtype=torch.long)
    for i, n in enumerate(lens):
        need = -(-n // bs)
        tables[i, :need] = torch.tensor(free[:need])
        del free[:need]
    return k_cache, v_cache, tables


def _compare_paged(backend_device: str, dtypes=(torch.float32, torch.bfloat16)) -> None:
    """Triton paged decode attention vs the torch reference: GQA groups of 1, 3
    and 4, contexts inside one block, across blocks and long enough to split, a
    padded block table, and in bfloat16 batches on either side of the kernel's
    change of tiles (48 rows: one tile of 128 keys; 180 rows: tiles of 64).
    (Triton's interpreter multiplies bfloat16 wrongly in ``tl.dot``, so it
    checks float32 only.)"""
    gen = torch.Generator().manual_seed(3)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.03)):
        if dtype not in dtypes:
            continue
        cases = [(9, 3, 64, 16, [1, 16, 17, 300, 95]), (8, 2, 64, 16, [700]),
                 (4, 4, 32, 32, [5, 64, 65]), (6, 3, 64, 16, [2100]),
                 (9, 3, 64, 16, [1 + 7 * i for i in range(48)])]
        if dtype == torch.bfloat16:  # (float32 keeps one tile size)
            cases.append((9, 3, 64, 16, [1 + 2 * i for i in range(180)]))
        for h, hkv, d, bs, lens in cases:
            k_cache, v_cache, tables = _paged_cache(gen, lens, hkv, d, bs, dtype)
            q = torch.randn(len(lens), h, d, generator=gen).to(dtype)
            args = [t.to(backend_device) for t in (q, k_cache, v_cache, tables,
                                                   torch.tensor(lens))]
            ref = paged_decode_attention(*args, d ** -0.5, backend="torch")
            got = paged_decode_attention(*args, d ** -0.5, backend="triton")
            assert got.dtype == dtype and got.shape == (len(lens), h, d)
            err = (got.float() - ref.float()).abs().max().item()
            assert err <= tol, f"{dtype} h={h} hkv={hkv} lens={lens}: max error {err}"
            one = paged_decode_attention(args[0][:1], *args[1:3], args[3][:1], args[4][:1],
                                         d ** -0.5, backend="triton")
            assert (one.float() - ref[:1].float()).abs().max().item() <= tol


def _fresh(t: torch.Tensor, device: str) -> torch.Tensor:
    """A copy of ``t`` on ``device`` (``.to`` alone hands back ``t`` itself when it
    is there already: runs on the CPU would write into one cache)."""
    return t.to(device, copy=True)


def _compare_rope_decode(backend_device: str, dtypes=(torch.float32, torch.bfloat16)) -> None:
    """The Triton decode attention that rotates its rows' new tokens and stores
    their keys and values itself, against the torch path (rotation, store,
    attention): the outputs, the cache slots it writes (as the rotation kernel
    writes them, and none other), the projection output left as it was; rows
    whose context is only the new token, contexts across blocks and long enough
    to split, GQA groups of 1, 3 and 4, a head dimension that is no power of two."""
    gen = torch.Generator().manual_seed(6)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.03)):
        if dtype not in dtypes:
            continue
        cases = [(9, 3, 64, 16, [1, 16, 17, 300, 95]), (8, 2, 64, 16, [700]),
                 (4, 4, 32, 32, [5, 64, 65]), (6, 2, 80, 16, [3, 40, 90]),
                 (9, 3, 64, 16, [1 + 7 * i for i in range(48)])]
        if dtype == torch.bfloat16:
            cases.append((9, 3, 64, 16, [1 + 2 * i for i in range(180)]))
        for h, hkv, d, bs, lens in cases:
            k_cache, v_cache, tables = _paged_cache(gen, lens, hkv, d, bs, dtype)
            positions = torch.tensor(lens) - 1
            slots = torch.stack([tables[i, p // bs] * bs + p % bs
                                 for i, p in enumerate(positions.tolist())])
            qkv = torch.randn(len(lens), (h + 2 * hkv) * d, generator=gen).to(dtype)
            cos, sin = RotaryEmbedding(d, 4096, 10000.0).tables(torch.device("cpu"))
            dev = [t.to(backend_device) for t in (qkv, positions, cos, sin, slots, tables,
                                                  torch.tensor(lens))]
            got_q, pos_d, cos_d, sin_d, slots_d, tables_d, lens_d = dev
            kv = {}
            for backend in ("torch", "triton"):
                kc, vc = _fresh(k_cache, backend_device), _fresh(v_cache, backend_device)
                out = rope_decode_attention(got_q, h, hkv, pos_d, cos_d, sin_d, kc, vc, slots_d,
                                            tables_d, lens_d, d ** -0.5, backend=backend)
                kv[backend] = (out, kc, vc)
            assert torch.equal(got_q.cpu(), qkv)  # (the projection's output is not rotated)
            (ref, _, _), (out, kt, vt) = kv["torch"], kv["triton"]
            assert out.dtype == dtype and out.shape == (len(lens), h, d)
            err = (out.float() - ref.float()).abs().max().item()
            assert err <= tol, f"{dtype} h={h} hkv={hkv} lens={lens}: max error {err}"
            # the cache as the rotation kernel leaves it (it rounds once, as this one
            # does; the torch path rounds after each operation), to the last bit but
            # one (the compiler may fuse a product into an addition either way)
            kc, vc = _fresh(k_cache, backend_device), _fresh(v_cache, backend_device)
            b_ = len(lens)
            apply_rope_and_store_kv_(got_q[:, :(h + hkv) * d].reshape(b_, h + hkv, d).clone(),
                                     got_q[:, (h + hkv) * d:].reshape(b_, hkv, d), pos_d,
                                     cos_d, sin_d, kc, vc, slots_d, backend="triton")
            ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -22
            for a, b in ((kt, kc), (vt, vc)):
                a, b = a.float(), b.float()
                assert ((a - b).abs() <= b.abs() * ulp).all()
            written = torch.zeros(k_cache.shape[0] * bs, dtype=torch.bool)
            written[slots] = True
            for a, b in ((kt, k_cache), (vt, v_cache)):  # (and no other slot)
                a, b = a.cpu().view(-1, hkv, d), b.view(-1, hkv, d)
                assert torch.equal(a[~written], b[~written])
            if h == 9 and lens[0] == 1:  # rows scaled by another tensor's inverse RMS
                scale_by = (torch.randn(len(lens), 200, generator=gen) * 3).to(dtype)
                sb = scale_by.to(backend_device)
                outs = []
                for backend in ("torch", "triton"):
                    kc, vc = _fresh(k_cache, backend_device), _fresh(v_cache, backend_device)
                    outs.append((rope_decode_attention(got_q, h, hkv, pos_d, cos_d, sin_d, kc, vc,
                                                       slots_d, tables_d, lens_d, d ** -0.5,
                                                       scale_by=sb, eps=1e-5, backend=backend),
                                 kc, vc))
                err = (outs[0][0].float() - outs[1][0].float()).abs().max().item()
                assert err <= tol, f"{dtype} scaled rows: max error {err}"
                assert (outs[0][0].float() - ref.float()).abs().max().item() > 10 * tol
                # the scaled keys and values stored: the values to the rounding of each
                # path's inverse RMS, the keys to that of the rotated inputs (a rotation
                # may cancel, so the bound is the head's size, not the output's)
                given = scale_rows(qkv[:, h * d:].view(b_, 2, hkv, d),
                                   scale_by[:, None, None, :].expand(b_, 2, hkv, 200), 1e-5)
                size = given.float().abs().amax(-1, keepdim=True)  # [B, 2, hkv, 1]
                for which, bound in ((1, ulp * 4 * size[:, 0]), (2, ulp * size[:, 1])):
                    a, b = (o[which].cpu().view(-1, hkv, d)[slots].float() for o in outs)
                    assert ((a - b).abs() <= bound + 1e-6).all(), (which, (a - b).abs().max())
                stored = outs[1][2].cpu().view(-1, hkv, d)[slots]   # (scaled: not the values
                assert not torch.equal(stored, qkv[:, (h + hkv) * d:].view(-1, hkv, d))  # as given)


def _compare_prefill(backend_device: str, dtypes=(torch.float32, torch.bfloat16)) -> None:
    """Triton paged prefill attention vs the torch reference: several chunks in one
    step (a first chunk, continuations with earlier tokens cached, one token, a
    chunk longer than a tile), GQA, the rows between chunks left alone."""
    gen = torch.Generator().manual_seed(4)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.03)):
        if dtype not in dtypes:
            continue
        for h, hkv, d, bs in ((9, 3, 64, 16), (4, 4, 32, 32)):
            chunks = [(20, 20), (7, 90), (1, 33), (130, 300)]     # (length, context)
            nb_total = sum(-(-c // bs) for _, c in chunks) + 2
            k_cache = torch.randn(nb_total, bs, hkv, d, generator=gen).to(dtype)
            v_cache = torch.randn(nb_total, bs, hkv, d, generator=gen).to(dtype)
            free = torch.randperm(nb_total, generator=gen).tolist()
            starts, tables, row = [], [], 2      # two rows before the first chunk
            for length, context in chunks:
                need = -(-context // bs)
                tables.append(torch.tensor(free[:need]))
                del free[:need]
                starts.append(row)
                row += length + 1                 # a row between chunks
            q = torch.randn(row, h, d, generator=gen).to(dtype)
            args = [t.to(backend_device) for t in (q, k_cache, v_cache)]
            tabs = [t.to(backend_device) for t in tables]
            outs = {}
            for backend in ("torch", "triton"):
                out = torch.full_like(args[0], 7.0)
                paged_prefill_attention_(out, *args, starts, [c[0] for c in chunks],
                                         [c[1] for c in chunks], tabs, d ** -0.5,
                                         backend=backend)
                outs[backend] = out.float()
            err = (outs["torch"] - outs["triton"]).abs().max().item()
            assert err <= tol, f"{dtype} h={h} hkv={hkv}: max error {err}"
            assert torch.all(outs["triton"][:2] == 7.0)   # rows of no chunk untouched


def _compare_sampling(backend_device: str, backends=("torch", "triton")) -> None:
    """Batched sampling: each row keeps exactly the reference's tokens (top-k with
    ties, top-p, min-p, masked logits), draws inside them, repeats with its seed
    whatever the other rows are, and follows the tempered distribution."""
    gen = torch.Generator().manual_seed(5)
    b, v = 6, 3000
    x = torch.randn(b, v, generator=gen) * 3
    x[1, 100:] = float("-inf")                  # a grammar mask
    x[2, :40] = x[2].max() + 1                  # ties at the top-k boundary
    temp = torch.tensor([1.0, 0.7, 1.3, 1.0, 2.0, 0.5])
    top_k = torch.tensor([0, 5, 30, 0, 0, 20])
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.5, 1.0, 0.8])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.1, 0.05])
    seeds = torch.arange(b) * 7 + 1
    ref = sampling_thresholds(x, temp, top_k, top_p, min_p)
    dev = [t.to(backend_device) for t in (x, temp, top_k, top_p, min_p, seeds)]
    for backend in backends:
        tokens, thr = sample(*dev, backend=backend)
        tokens, thr = tokens.cpu(), thr.cpu()
        for i in range(b):
            assert torch.equal(x[i] >= thr[i], x[i] >= ref[i]), f"{backend} row {i} support"
            assert x[i, tokens[i]] >= ref[i]
        again, _ = sample(*dev, backend=backend)
        assert torch.equal(again.cpu(), tokens)
        alone, _ = sample(*(t[3:4] for t in dev), backend=backend)   # batch invariance
        assert int(alone) == int(tokens[3])
    # the draws follow softmax(x / T) over the kept tokens
    n, v = 3000, 16
    row = torch.randn(v, generator=gen)
    xs = row.expand(n, v).contiguous()
    # (min-p cuts without the bisections, which Triton's interpreter runs slowly)
    params = (torch.full((n,), 0.8), torch.zeros(n, dtype=torch.long), torch.ones(n),
              torch.full((n,), 0.1), torch.arange(n))
    thr = sampling_thresholds(xs[:1], *(p[:1] for p in params[:4]))
    want = torch.where(row >= thr, torch.softmax(row / 0.8, 0), torch.zeros(v))
    want = want / want.sum()
    for backend in backends:
        tokens, _ = sample(xs.to(backend_device), *(p.to(backend_device) for p in params),
                           backend=backend)
        freq = torch.bincount(tokens.cpu(), minlength=v).float() / n
        assert (freq - want).abs().max().item() < 0.035, (backend, freq, want)


def _compare_greedy(backend_device: str) -> None:
    """Greedy picks (Triton: each row split over programs) against the first
    maximum: ties inside a part and across parts, rows all -inf (dead ends),
    a vocabulary narrower than the logits, widths that are not whole parts."""
    from formcast.engine.kernels.sampling import greedy_picks

    gen = torch.Generator().manual_seed(8)
    for rows, width, vocab in ((5, 3000, None), (7, 13000, 12500), (1, 49152, None),
                               (300, 6145, 6145)):
        x = torch.randn(rows, width, generator=gen)
        x[0, 2] = x[0, width - 1] = x[0].max() + 1      # a tie across parts (and blocks)
        if rows > 2:
            x[1] = float("-inf")                        # a dead end
            x[2, 10:] = float("-inf")
            x[2, 3] = x[2, 7] = 5.0                     # a tie inside a block
        if vocab is not None:
            x[-1, vocab:] = 1e9                         # past the vocabulary: never picked
        want_ids = x[:, :vocab].argmax(-1)              # (the first maximum)
        want_dead = torch.isneginf(x[:, :vocab].max(-1).values).long()
        for backend in ("torch", "triton"):
            got = greedy_picks(x.to(backend_device), vocab, backend=backend).cpu()
            if rows > 2:
                got[0, 1] = want_ids[1]                 # (a dead end's token is not read)
            assert torch.equal(got[0], want_ids), backend
            assert torch.equal(got[1], want_dead), backend


def _compare_moe(backend_device: str, dtypes=(torch.float32, torch.bfloat16)) -> None:
    """Triton grouped expert GEMMs vs the per-expert torch reference: one token and
    many, experts left empty, every token on one expert, K of 1 to 3, widths that
    are not multiples of the tiles, the activation's clamp reached."""
    gen = torch.Generator().manual_seed(6)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.05)):
        if dtype not in dtypes:
            continue
        for t, x_n, k, e, i in ((1, 8, 2, 64, 96), (37, 8, 3, 80, 48), (70, 4, 1, 64, 64),
                                (20, 6, 2, 64, 32)):
            x = torch.randn(t, e, generator=gen)
            gate_up = torch.randn(x_n, 2 * i, e, generator=gen) * 0.3
            down = torch.randn(x_n, e, i, generator=gen) * 0.3
            experts = torch.randint(0, x_n - 1, (t, k), generator=gen)   # the last one idle
            if t == 20:
                experts[:] = 2                                             # all on one expert
            weights = torch.rand(t, k, generator=gen)
            args = [a.to(dtype).to(backend_device) for a in (x, gate_up, down)]
            route = [experts.to(backend_device), weights.to(backend_device)]
            ref = grouped_expert_mlp(*args, *route, 2.0, backend="torch").float()
            got = grouped_expert_mlp(*args, *route, 2.0, backend="triton")
            assert got.dtype == dtype and got.shape == (t, e)
            err = ((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1)).item()
            assert err <= tol, f"{dtype} t={t} x={x_n} k={k}: relative error {err}"


@pytest.mark.cuda
def test_triton_kernels_match_the_reference_on_cuda():
    _compare("cuda")
    _compare_paged("cuda")
    _compare_rope_decode("cuda")
    _compare_prefill("cuda")
    _compare_sampling("cuda")
    _compare_greedy("cuda")
    _compare_moe("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the CUDA test runs the kernels")
def test_triton_kernels_match_the_reference_in_the_interpreter():
    """Where no GPU runs them, the kernels still run: in Triton's interpreter (the
    interpreter of the Triton build shipped with CUDA torch differs). Two
    processes side by side: the sampling kernels' draws (thousands of programs,
    interpreted) take as long as all the others."""
    pytest.importorskip("triton")
    head = textwrap.dedent("""
        import sys
        import torch
        sys.path.insert(0, {here!r})
        from test_kernels import (_compare, _compare_paged, _compare_prefill, _compare_sampling,
                                  _compare_greedy, _compare_moe, _compare_rope_decode)
    """).format(here=os.path.dirname(__file__))
    parts = [textwrap.dedent("""
        _compare_sampling("cpu", backends=("triton",))
    """), textwrap.dedent("""
        _compare("cpu")
        _compare_paged("cpu", dtypes=(torch.float32,))
        _compare_rope_decode("cpu", dtypes=(torch.float32,))
        _compare_prefill("cpu", dtypes=(torch.float32,))
        _compare_greedy("cpu")
        _compare_moe("cpu", dtypes=(torch.float32,))
        from test_bitmask_cuda import _masked_argmax_case
        for vocab, mask_vocab, sliced in ((1000, 999, False), (5000, 4097, True)):
            ref = _masked_argmax_case(vocab, mask_vocab, "cpu", "torch", True, sliced)
            got = _masked_argmax_case(vocab, mask_vocab, "cpu", "triton", True, sliced)
            assert all(torch.equal(a, b) for a, b in zip(ref, got))
        for copied, shared in ((7, False), (1100, True)):  # (into a fresh output)
            ref = _masked_argmax_case(1000, 999, "cpu", "torch", shared, True, copied)
            got = _masked_argmax_case(1000, 999, "cpu", "triton", shared, True, copied)
            assert all(torch.equal(a, b) for a, b in zip(ref, got))
    """)]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    runs = [subprocess.Popen([sys.executable, "-c", head + part + "print('ok')"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for part in parts]
    try:
        for run in runs:
            out, err = run.communicate(timeout=300)
            assert run.returncode == 0 and "ok" in out, err[-3000:]
    finally:
        for run in runs:  # (the other one, when one failed)
            run.kill()
            run.wait()


@pytest.mark.cuda
def test_to_device_reuses_its_pinned_buffers_only_once_the_device_read_them():
    """Integer lists go to the device through a ring of pinned buffers: with the
    stream held up behind a long kernel, lists written into every buffer in
    turn (more lists than buffers) still arrive as they were written."""
    from formcast.engine.kernels import _PinnedRing, to_device

    dev = torch.device("cuda")
    x = torch.randn(4096, 4096, device=dev)
    torch.cuda.synchronize()
    for _ in range(6):
        x = x @ x / 64  # (the copies queue behind these)
    lists = [[k * 1000 + j for j in range(k % 5 + 1)] for k in range(3 * _PinnedRing.SLOTS)]
    got = [to_device(values, torch.long, dev) for values in lists]
    assert [g.tolist() for g in got] == lists
    assert to_device([True, False], torch.bool, dev).tolist() == [True, False]
    assert to_device([[1, 2], [3, 4]], torch.long, dev).tolist() == [[1, 2], [3, 4]]
    big = list(range(_PinnedRing.SIZE + 1))
    assert to_device(big, torch.long, dev)[-3:].tolist() == big[-3:]
