"""The parts the model families added, one at a time: sliding-window and
soft-capped attention (torch reference against a dense computation; the Triton
kernels against the reference in Triton's interpreter), the GELU-tanh gate,
Gemma's ``1 + w`` norm, LongRoPE tables, and the GGUF types Q5_0, Q5_1, Q5_K, Q8_K
against hand-built blocks and scalar ports of ggml's decoders."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from formcast.engine.kernels.activation import gelu_tanh_and_mul
from formcast.engine.kernels.paged_attention import (paged_decode_attention,
                                                     paged_prefill_attention_)
from formcast.engine.layers.norm import RMSNorm
from formcast.engine.layers.rotary import rope_tables
from formcast.engine.loader.dequant import dequantize

# ------------------------------------------------------------------ attention


def _cache(gen: torch.Generator, length: int, hkv: int, d: int, bs: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence's dense keys/values [S, Hkv, D] and the same in shuffled
    blocks of ``bs`` (caches [NB + 2, BS, Hkv, D], table [NB + 1], padded)."""
    k = torch.randn(length, hkv, d, generator=gen)
    v = torch.randn(length, hkv, d, generator=gen)
    nb = -(-length // bs)
    order = torch.randperm(nb + 2, generator=gen)[:nb]
    k_cache = torch.randn(nb + 2, bs, hkv, d, generator=gen)
    v_cache = torch.randn(nb + 2, bs, hkv, d, generator=gen)
    for i in range(nb):
        part = slice(i * bs, min(length, (i + 1) * bs))
        k_cache[order[i], :part.stop - part.start] = k[part]
        v_cache[order[i], :part.stop - part.start] = v[part]
    return k, v, k_cache, v_cache, torch.cat([order, order[:1]])


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor, scale: float,
           window: int | None, softcap: float | None) -> torch.Tensor:
    """Attention written out: q [L, H, D] at positions ``qpos`` over k, v [S, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("lhd,shd->hls", q, kk) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    kpos = torch.arange(k.shape[0])
    seen = kpos[None, :] <= qpos[:, None]
    if window is not None:
        seen &= kpos[None, :] > qpos[:, None] - window
    s = s.masked_fill(~seen, float("-inf"))
    return torch.einsum("hls,shd->lhd", torch.softmax(s, -1), vv)


@pytest.mark.parametrize("length, window, softcap", [
    (40, 8, None), (40, 1, None), (40, 64, None), (40, None, 5.0), (33, 8, 5.0), (16, 16, None)])
def test_decode_attention_sees_its_window(length: int, window, softcap) -> None:
    gen = torch.Generator().manual_seed(length)
    k, v, k_cache, v_cache, table = _cache(gen, length, 2, 16, 8)
    q = torch.randn(1, 4, 16, generator=gen)
    got = paged_decode_attention(q, k_cache, v_cache, table[None], torch.tensor([length]), 0.25,
                                 window=window, softcap=softcap, backend="torch")
    want = _dense(q, k, v, torch.tensor([length - 1]), 0.25, window, softcap)
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("length, context, window, softcap", [
    (40, 40, 8, None), (12, 40, 8, None), (40, 40, None, 5.0), (12, 40, 8, 5.0), (7, 7, 3, None)])
def test_prefill_attention_sees_its_window(length: int, context: int, window, softcap) -> None:
    """A chunk of ``length`` queries ending at ``context`` (cached tokens before it)."""
    gen = torch.Generator().manual_seed(context + length)
    k, v, k_cache, v_cache, table = _cache(gen, context, 2, 16, 8)
    q = torch.randn(length, 4, 16, generator=gen)
    out = torch.empty_like(q)
    paged_prefill_attention_(out, q, k_cache, v_cache, [0], [length], [context], [table], 0.25,
                             k=k[context - length:], v=v[context - length:], window=window,
                             softcap=softcap, backend="torch")
    want = _dense(q, k, v, torch.arange(context - length, context), 0.25, window, softcap)
    assert (out - want).abs().max().item() <= 1e-5


_INTERPRETED = """
import torch
from formcast.engine.kernels.paged_attention import (
    paged_decode_attention, paged_prefill_attention_, rope_decode_attention)
from formcast.engine.kernels.activation import gelu_tanh_and_mul
from formcast.engine.layers.rotary import rope_tables

gen = torch.Generator().manual_seed(0)
hkv, h, d, bs = 2, 4, 16, 8
lens = [5, 40, 77]
nb = sum(-(-n // bs) for n in lens) + 2
k_cache = torch.randn(nb, bs, hkv, d, generator=gen)
v_cache = torch.randn(nb, bs, hkv, d, generator=gen)
free = torch.randperm(nb, generator=gen).tolist()
tables = torch.zeros(len(lens), -(-max(lens) // bs) + 1, dtype=torch.long)
for i, n in enumerate(lens):
    tables[i, :-(-n // bs)] = torch.tensor(free[:-(-n // bs)])
    del free[:-(-n // bs)]
lens_t = torch.tensor(lens)
for window, softcap in ((None, None), (8, None), (1, None), (30, 4.0), (None, 4.0)):
    q = torch.randn(len(lens), h, d, generator=gen)
    ref = paged_decode_attention(q, k_cache, v_cache, tables, lens_t, 0.3, window=window,
                                 softcap=softcap, backend="torch")
    got = paged_decode_attention(q, k_cache, v_cache, tables, lens_t, 0.3, window=window,
                                 softcap=softcap, backend="triton")
    assert (got - ref).abs().max().item() <= 1e-4, ("decode", window, softcap)
    qp = torch.randn(sum(lens), h, d, generator=gen)
    starts = [0, lens[0], lens[0] + lens[1]]
    chunk = [min(n, 20) for n in lens]
    outs = []
    for backend in ("torch", "triton"):
        out = torch.zeros(sum(lens), h, d)
        paged_prefill_attention_(out, qp, k_cache, v_cache, starts, chunk, lens,
                                 list(tables), 0.3, window=window, softcap=softcap,
                                 backend=backend)
        outs.append(out)
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-4, ("prefill", window, softcap)
cos, sin = rope_tables(d, 128, 10000.0, None)
for window in (None, 8, 1):
    qkv = torch.randn(len(lens), (h + 2 * hkv) * d, generator=gen)
    slots = torch.tensor([int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs
                          for i, n in enumerate(lens)])
    outs = []
    for backend in ("torch", "triton"):
        kc, vc = k_cache.clone(), v_cache.clone()
        outs.append(rope_decode_attention(qkv, h, hkv, lens_t - 1, cos, sin, kc, vc, slots,
                                          tables, lens_t, 0.3, window=window, backend=backend))
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-4, ("rope decode", window)
x = torch.randn(3, 2 * 40, generator=gen)
assert (gelu_tanh_and_mul(x, backend="triton") - gelu_tanh_and_mul(x, backend="torch")
        ).abs().max().item() <= 1e-5
print("ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the CUDA runs check it")
def test_triton_window_and_softcap_match_the_reference_in_the_interpreter() -> None:
    """Decode, prefill and rope-decode kernels with windows (wide, short, one
    token) and caps, and the GELU gate, in Triton's interpreter."""
    pytest.importorskip("triton")
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(_INTERPRETED)],
                         env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-3000:]


# ------------------------------------------------------------ layers and tables


def test_gelu_tanh_gate_is_transformers_gelu_pytorch_tanh() -> None:
    x = torch.randn(5, 2 * 24, generator=torch.Generator().manual_seed(0)) * 3
    gate, up = x.split(24, -1)
    want = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3)))
    assert (gelu_tanh_and_mul(x) - want * up).abs().max().item() <= 1e-5


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_norm_scales_by_offset_plus_weight(offset: float) -> None:
    norm = RMSNorm(8, 1e-6, offset=offset)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.5, 8))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (offset + norm.weight)
    assert (norm(x) - want).abs().max().item() <= 1e-6
    with torch.no_grad():  # a new weight is seen (the kept sum follows it)
        norm.weight.fill_(0.25)
    assert (norm(x) - want / (offset + torch.linspace(-0.5, 0.5, 8)) * (offset + 0.25)
            ).abs().max().item() <= 1e-5


@pytest.mark.parametrize("position, factors", [(0, "short"), (63, "short"), (64, "long"),
                                               (200, "long")])
def test_longrope_tables_take_each_side_s_factors(position: int, factors: str) -> None:
    short, long = [1.0 + 0.1 * i for i in range(4)], [2.0 + 0.5 * i for i in range(4)]
    scaling = {"rope_type": "longrope", "short_factor": short, "long_factor": long,
               "original_max_position_embeddings": 64}
    cos, sin = rope_tables(8, 256, 10000.0, scaling)
    chosen = torch.tensor(short if factors == "short" else long)
    inv = 1.0 / (chosen * 10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    factor = math.sqrt(1 + math.log(256 / 64) / math.log(64))  # the attention factor
    angle = position * inv
    assert torch.allclose(cos[position, :4], angle.cos() * factor, atol=1e-6)
    assert torch.allclose(sin[position, 4:], angle.sin() * factor, atol=1e-6)


# ------------------------------------------------------------------ GGUF types


def _f16(x: float) -> bytes:
    return np.float16(x).tobytes()


def _q5_block(d: float, m: float | None, codes: list[int]) -> bytes:
    """A Q5_0 (``m`` None) or Q5_1 block of 32 five-bit ``codes``."""
    qh = sum(((c >> 4) & 1) << j for j, c in enumerate(codes))
    qs = bytes((codes[j] & 0xF) | ((codes[j + 16] & 0xF) << 4) for j in range(16))
    return _f16(d) + (b"" if m is None else _f16(m)) + qh.to_bytes(4, "little") + qs


@pytest.mark.parametrize("qtype, m", [(Q.Q5_0, None), (Q.Q5_1, -1.5)])
def test_dequant_q5_hand_built(qtype: Q, m) -> None:
    codes = [(7 * j + 3) % 32 for j in range(32)]
    raw = np.frombuffer(_q5_block(0.5, m, codes), dtype=np.uint8)
    got = dequantize(raw, qtype, (1, 32))
    want = [0.5 * (c - 16) for c in codes] if m is None else [0.5 * c + m for c in codes]
    assert torch.equal(got, torch.tensor([want], dtype=torch.float32))


def test_dequant_q8_k_hand_built() -> None:
    codes = np.array([(j * 37) % 256 - 128 for j in range(256)], dtype=np.int8)
    block = np.float32(0.125).tobytes() + codes.tobytes() + bytes(32)  # (block sums unused)
    got = dequantize(np.frombuffer(block * 2, dtype=np.uint8), Q.Q8_K, (2, 256))
    assert torch.equal(got, torch.from_numpy(codes.astype(np.float32) * 0.125).repeat(2, 1))


def _ref_q5_k(block: bytes) -> list[np.float32]:
    """Scalar port of ggml's dequantize_row_q5_K for one 256-value block (176 bytes)."""
    d, dmin = np.frombuffer(block[:4], dtype=np.float16).astype(np.float32)
    scales, qh, ql = block[4:16], block[16:48], block[48:176]

    def scale_min(j: int) -> tuple[np.float32, np.float32]:
        if j < 4:
            sc, m = scales[j] & 63, scales[j + 4] & 63
        else:
            sc = (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4)
            m = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)
        return np.float32(sc), np.float32(m)

    out: list[np.float32] = []
    for group in range(4):
        sc1, m1 = scale_min(2 * group)
        sc2, m2 = scale_min(2 * group + 1)
        d1, dm1, d2, dm2 = d * sc1, dmin * m1, d * sc2, dmin * m2
        lo, u1, u2 = ql[32 * group: 32 * group + 32], 1 << (2 * group), 2 << (2 * group)
        out += [d1 * np.float32((b & 0xF) + (16 if h & u1 else 0)) - dm1 for b, h in zip(lo, qh)]
        out += [d2 * np.float32((b >> 4) + (16 if h & u2 else 0)) - dm2 for b, h in zip(lo, qh)]
    return out


def test_dequant_q5_k_against_ggml_reference() -> None:
    rng = np.random.default_rng(5)
    blocks = [(rng.uniform(-1, 1, 2) * 0.01).astype(np.float16).tobytes() + rng.bytes(172)
              for _ in range(4)]
    got = dequantize(np.frombuffer(b"".join(blocks), dtype=np.uint8), Q.Q5_K, (2, 512))
    want = np.array([v for b in blocks for v in _ref_q5_k(b)], dtype=np.float32).reshape(2, 512)
    assert torch.allclose(got, torch.from_numpy(want), rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------- config.json files

_SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("fields, windows", [
    # Qwen2.5's own files name a window they do not use
    ({"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 32768,
      "max_window_layers": 2}, [None] * 4),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16,
      "max_window_layers": 2}, [None, None, 16, 16]),
    ({"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 16,
      "layer_types": ["sliding_attention", "full_attention"] * 2}, [16, None, 16, None]),
    ({"model_type": "mistral", "sliding_window": 16}, [16] * 4),
    ({"model_type": "mistral", "sliding_window": None}, [None] * 4),
    ({"model_type": "phi3", "sliding_window": 12}, [12] * 4),
    # an older Gemma 3 file: window pattern, local RoPE base and scaling by name
    ({"model_type": "gemma3_text", "sliding_window": 8, "sliding_window_pattern": 2,
      "rope_local_base_freq": 500.0, "rope_theta": 1e6,
      "rope_scaling": {"rope_type": "linear", "factor": 8.0}}, [8, None, 8, None]),
])
def test_config_json_windows(fields: dict, windows: list) -> None:
    from formcast.engine.models.decoder_config import DecoderConfig

    config = DecoderConfig.from_hf_dict({**_SHAPE, **fields})
    assert [config.window(i) for i in range(4)] == windows
    if fields["model_type"] == "gemma3_text":
        assert (config.local_rope_theta, config.rope_theta) == (500.0, 1e6)
        assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
        assert config.tie_word_embeddings and config.norm_offset == 1.0
