"""Rotary position embedding (rotate-half layout, as transformers' Llama).

Scalings: linear, Llama 3's, and LongRoPE (Phi-3's "longrope", formerly "su"):
per-frequency factors, short ones for positions inside the original context and
long ones past it, and cos/sin scaled by an attention factor. transformers
switches a whole forward to the long factors once its sequence outgrows the
original context; a paged cache rotates each key once, so here each position
takes the factors of its own side (the same tables wherever a sequence stays
inside the original context).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from formcast.engine.kernels import triton_available
from formcast.engine.kernels.rope import apply_rope_, apply_rope_and_store_kv_


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]``, with Llama-3 style scaling if configured."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(is_mid, mid, scaled)
    if kind in ("longrope", "su"):
        return _longrope_inv_freq(head_dim, theta, scaling["short_factor"])
    raise ValueError(f"unsupported rope scaling type {kind!r} "
                     "(supported: default, linear, llama3, longrope)")


def rope_tables(head_dim: int, max_positions: int, theta: float,
                scaling: dict[str, Any] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, float32 ``[max_positions, head_dim]`` (each row two equal
    halves), with the scaling of the module doc."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, rope_inv_freq(head_dim, theta, scaling))
    factor = 1.0
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if kind in ("longrope", "su"):
        original = int(scaling["original_max_position_embeddings"])
        long_freq = _longrope_inv_freq(head_dim, theta, scaling["long_factor"])
        freqs[original:] = torch.outer(positions[original:], long_freq)
        factor = scaling.get("attention_factor")
        if factor is None:
            ratio = scaling.get("factor") or max_positions / original
            factor = 1.0 if ratio <= 1.0 else math.sqrt(1 + math.log(ratio) / math.log(original))
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    if factor != 1.0:
        return emb.cos() * factor, emb.sin() * factor
    return emb.cos(), emb.sin()


def _longrope_inv_freq(head_dim: int, theta: float, factors: list[float]) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** exponents)


class RotaryEmbedding(nn.Module):
    """cos/sin tables (float32, built on first use on the positions' device), applied
    to q and k. The tables are plain attributes, not buffers, so moving the model to
    a lower precision never degrades them."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self._last: tuple | None = None  # (positions, dtype, cos, sin) of the last step

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tables is None or self._tables[0].device != device:
            cos, sin = rope_tables(self.head_dim, self.max_positions, self.theta, self.scaling)
            self._tables = (cos.to(device), sin.to(device))
        return self._tables

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, heads, D] rotated at ``positions`` [T] (q and k heads may come
        together: each head rotates by itself)."""
        if x.is_cuda and triton_available():  # in place, one kernel
            return apply_rope_(x, positions, *self.tables(positions.device))
        cos, sin = self.halves(positions, x.dtype)
        return _rotate(x, cos, sin)

    def rotate_and_store(self, positions: torch.Tensor, qk: torch.Tensor, v: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
                         ) -> tuple[torch.Tensor, bool]:
        """:meth:`rotate` of ``qk`` [T, H + Hkv, D]; on CUDA the same kernel writes the
        rotated key heads and ``v`` to the cache ``slots``. Returns the rotated
        ``qk`` and whether the keys and values were stored."""
        if qk.is_cuda and triton_available():
            return apply_rope_and_store_kv_(qk, v, positions, *self.tables(positions.device),
                                            k_cache, v_cache, slots), True
        return self.rotate(positions, qk), False

    def halves(self, positions: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, D/2]`` at ``positions`` (the two halves of a row of the
        tables are equal). Every layer of a step asks with the same ``positions``
        tensor, so the gather runs once per step."""
        last = self._last
        if last is not None and last[0] is positions and last[1] == dtype:
            return last[2], last[3]
        cos_table, sin_table = self.tables(positions.device)
        half = self.head_dim // 2
        cos = cos_table[positions, :half].unsqueeze(1).to(dtype)  # [T, 1, D/2]
        sin = sin_table[positions, :half].unsqueeze(1).to(dtype)
        self._last = (positions, dtype, cos, sin)
        return cos, sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (transformers' formula, the same bits),
    on halves: ``[x1 c - x2 s, x2 c + x1 s]``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
