"""Triton grouped expert GEMMs for CUDA (see :mod:`formcast.engine.kernels.moe`).

Layout: the T*K (token, expert) pairs sorted by expert, each expert's run padded
to a multiple of ``BLOCK_M`` so that every tile of ``BLOCK_M`` slots belongs to one
expert; ``slot_pair`` maps slots to pairs (``T*K`` marks padding) and
``tile_expert`` tiles to experts (``X`` past the last tile). The grid is sized for
the worst case (every expert a partial tile), so no count comes to the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tile_rows(tile_expert_ptr, slot_pair_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """This program's tile: its expert (``NUM_EXPERTS`` or more past the last tile),
    its slots, their pairs and which slots hold one (the rest are padding)."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    slots = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(slot_pair_ptr + slots)
    return expert, slots, pair, pair < num_pairs


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """``a @ b`` in float32; IEEE: exact float32 products (no TF32)."""
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, h_ptr, slot_pair_ptr, tile_expert_ptr, num_pairs, top_k,
                    hidden, inter, limit, stride_xt, stride_we, stride_wn, stride_hs,
                    NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    nb = tl.program_id(1)
    expert, slots, pair, live_m = _tile_rows(tile_expert_ptr, slot_pair_ptr, num_pairs, BLOCK_M)
    if expert < NUM_EXPERTS:
        token = (pair // top_k).to(tl.int64)
        n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        live_n = n < inter
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        w_base = w_ptr + expert * stride_we
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            live_k = k < hidden
            a = tl.load(x_ptr + token[:, None] * stride_xt + k[None, :],
                        mask=live_m[:, None] & live_k[None, :], other=0.0)
            wmask = live_k[:, None] & live_n[None, :]
            wg = tl.load(w_base + n[None, :] * stride_wn + k[:, None], mask=wmask, other=0.0)
            wu = tl.load(w_base + (n[None, :] + inter) * stride_wn + k[:, None], mask=wmask,
                         other=0.0)
            acc_g += _dot(a, wg, IEEE)
            acc_u += _dot(a, wu, IEEE)
        g = tl.minimum(acc_g, limit)
        u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        h = g / (1.0 + tl.exp(-g)) * u
        tl.store(h_ptr + slots[:, None] * stride_hs + n[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=live_m[:, None] & live_n[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, y_ptr, weights_ptr, slot_pair_ptr, tile_expert_ptr, num_pairs,
                 hidden, inter, stride_hs, stride_we, stride_wn, stride_yp,
                 NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    nb = tl.program_id(1)
    expert, slots, pair, live_m = _tile_rows(tile_expert_ptr, slot_pair_ptr, num_pairs, BLOCK_M)
    if expert < NUM_EXPERTS:
        n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        live_n = n < hidden
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        w_base = w_ptr + expert * stride_we
        for k0 in range(0, inter, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            live_k = k < inter
            a = tl.load(h_ptr + slots[:, None] * stride_hs + k[None, :],
                        mask=live_m[:, None] & live_k[None, :], other=0.0)
            w = tl.load(w_base + n[None, :] * stride_wn + k[:, None],
                        mask=live_k[:, None] & live_n[None, :], other=0.0)
            acc += _dot(a, w, IEEE)
        rw = tl.load(weights_ptr + pair, mask=live_m, other=0.0).to(tl.float32)
        acc = acc * rw[:, None]
        tl.store(y_ptr + pair.to(tl.int64)[:, None] * stride_yp + n[None, :], acc,
                 mask=live_m[:, None] & live_n[None, :])


def tile_layout(experts: torch.Tensor, num_experts: int, block_m: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot_pair [slots], tile_expert [tiles]) for the pairs ``experts.flatten()``,
    built on the device without a host sync."""
    dev = experts.device
    flat = experts.flatten().long()
    pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    run_start = torch.cumsum(counts, 0) - counts
    sorted_expert = flat[order]
    rank = torch.arange(pairs, device=dev) - run_start[sorted_expert]
    tiles = -(-pairs // block_m) + num_experts
    slot_pair = torch.full((tiles * block_m,), pairs, dtype=torch.long, device=dev)
    slot_pair[padded_start[sorted_expert] + rank] = order
    tile_start = torch.arange(tiles, device=dev) * block_m
    tile_expert = torch.searchsorted(padded_end, tile_start, right=True)  # X past the end
    return slot_pair, tile_expert


def grouped_expert_mlp_triton(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                              experts: torch.Tensor, weights: torch.Tensor, limit: float, *,
                              invariant: bool = False) -> torch.Tensor:
    """``invariant``: tiles of 16 slots whatever the batch (batch-invariant mode);
    otherwise 64 once the pairs fill them."""
    t, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    top_k = experts.shape[1]
    if x.stride(1) != 1 or gate_up.stride(2) != 1 or down.stride(2) != 1:
        raise ValueError("grouped experts: x rows and expert weight rows must be contiguous")
    block_m = 16 if invariant or t * top_k <= 64 * num_experts else 64
    slot_pair, tile_expert = tile_layout(experts, num_experts, block_m)
    tiles = tile_expert.numel()
    pairs = t * top_k
    h = torch.empty(tiles * block_m, inter, dtype=x.dtype, device=x.device)
    ieee = x.dtype == torch.float32
    _gate_up_kernel[(tiles, triton.cdiv(inter, 64))](
        x, gate_up, h, slot_pair, tile_expert, pairs, top_k, hidden, inter, float(limit),
        x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0),
        NUM_EXPERTS=num_experts, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, IEEE=ieee)
    y = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    _down_kernel[(tiles, triton.cdiv(hidden, 64))](
        h, down, y, weights.flatten().contiguous(), slot_pair, tile_expert, pairs, hidden, inter,
        h.stride(0), down.stride(0), down.stride(1), y.stride(0),
        NUM_EXPERTS=num_experts, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, IEEE=ieee)
    return y.view(t, top_k, hidden).sum(dim=1).to(x.dtype)
