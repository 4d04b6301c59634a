"""Rotary position embedding (rotate-half layout), applied in place.

``x`` [T, heads, D] (any strides with a contiguous last dimension, e.g. the q|k
part of a fused projection's output) is rotated at ``positions`` [T] with the
float32 ``cos``/``sin`` tables [P, D] (each row two equal halves):
``[x1 c - x2 s, x2 c + x1 s]``, transformers' ``x * cos + rotate_half(x) * sin``.
The torch path is the reference and the CPU's; Triton runs on CUDA tensors.

:func:`apply_rope_and_store_kv_` also writes a step's new keys (the rotated
key heads) and values to their paged-cache slots: on CUDA one kernel for what
is otherwise a rotation and two scatters a layer.
"""

from __future__ import annotations

import torch

from formcast.engine.kernels import use_triton


def apply_rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Rotate ``x`` in place; returns it."""
    if x.shape[0] == 0:
        return x
    if use_triton(x, backend):
        from formcast.engine.kernels.rope_triton import apply_rope_triton_

        apply_rope_triton_(x, positions, cos, sin)
        return x
    half = x.shape[-1] // 2
    c = cos[positions, :half].unsqueeze(1).to(x.dtype)   # [T, 1, D/2]
    s = sin[positions, :half].unsqueeze(1).to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return x.copy_(rotated)


def apply_rope_and_store_kv_(qk: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                             cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, slots: torch.Tensor, *,
                             backend: str = "auto") -> torch.Tensor:
    """Rotate ``qk`` [T, H + Hkv, D] in place (query heads, then key heads), then
    write its key heads and ``v`` [T, Hkv, D] to slot ``slots[t]`` of the caches
    ([NBtotal, BS, Hkv, D]; slot = block * BS + offset). Returns ``qk``."""
    if qk.shape[0] == 0:
        return qk
    hkv = v.shape[1]
    if use_triton(qk, backend):
        from formcast.engine.kernels.rope_triton import apply_rope_and_store_kv_triton_

        apply_rope_and_store_kv_triton_(qk, v, positions, cos, sin, k_cache, v_cache, slots)
        return qk
    apply_rope_(qk, positions, cos, sin, backend="torch")
    store_kv_(k_cache, v_cache, qk[:, qk.shape[1] - hkv:], v, slots)
    return qk


def store_kv_(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              slots: torch.Tensor) -> None:
    """Keys and values ``[T, Hkv, D]`` into the caches ``[NBtotal, BS, Hkv, D]`` at ``slots``."""
    hkv, d = k.shape[1], k.shape[2]
    k_cache.view(-1, hkv, d).index_copy_(0, slots, k)
    v_cache.view(-1, hkv, d).index_copy_(0, slots, v)
