"""Attention over the paged KV cache.

A step's tokens arrive flattened: ``[T]`` tokens from several sequences, each a
decode (one new token) or a prefill chunk (many). New keys/values are written to
their cache slots first; then decode rows are attended as one padded batch over
their gathered blocks, and each prefill chunk on its own (causal, with an offset
when earlier tokens of the sequence are already cached).

Shapes: T tokens this step, H query heads, Hkv key/value heads, D head dim,
Bd decode rows, S gathered context length, NB blocks, BS block size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from formcast.engine.kernels.paged_attention import (decode_masked_out, paged_decode_attention,
                                                     paged_prefill_attention_)
from formcast.engine.kernels.paged_attention_invariant import (decode_masked_keys,
                                                               decode_width,
                                                               invariant_decode_attention,
                                                               invariant_prefill_attention_,
                                                               prefill_masked_keys)
from formcast.engine.kernels.rope import apply_rope_and_store_kv_, store_kv_


@dataclass(frozen=True, kw_only=True)
class PrefillSpan:
    start: int          # first row of this chunk in the flat token batch
    length: int         # new tokens of the chunk
    context_len: int    # tokens of the sequence once the chunk is written
    block_table: torch.Tensor  # [NB] long


@dataclass(frozen=True, kw_only=True)
class AttentionMetadata:
    """Everything attention needs about the batch; built once per step, read by every layer."""

    slot_mapping: torch.Tensor          # [T] long: cache slot of each new token
    decode_rows: torch.Tensor           # [Bd] long: flat rows that are single-token decodes
    decode_block_tables: torch.Tensor   # [Bd, NB] long (padded with block 0)
    decode_lens: torch.Tensor           # [Bd] long: context length of each decode row
    prefills: tuple[PrefillSpan, ...]
    # the prefills as two device tensors, made once a step for every layer: (starts,
    # lengths, context lengths) [3, P] long and the block tables [P, NB] long, padded
    prefill_packed: tuple[torch.Tensor, torch.Tensor] | None = None
    # every decode row is its sequence's one new token (no draft positions): a kernel
    # may then store a row's key and value while the other rows attend
    one_token_rows: bool = False
    # batch-invariant mode (CPU): every row, prompt or decode, attends by the one
    # computation of kernels.paged_attention_invariant (fixed row tiles, fixed KV split)
    batch_invariant: bool = False

    def rely_on_one_token_rows(self) -> None:
        """A layer took a path that holds only with :attr:`one_token_rows` (a CUDA
        graph captured over this metadata must not then replay draft rows)."""
        object.__setattr__(self, "_relied", True)

    @property
    def relied_on_one_token_rows(self) -> bool:
        return self.__dict__.get("_relied", False)

    def prefill_args(self) -> tuple[list[int], list[int], list[int], list[torch.Tensor]]:
        """The prefills' starts, lengths, context lengths and block tables as lists,
        made once per step rather than once per layer."""
        cached = self.__dict__.get("_prefill_args")
        if cached is None:
            spans = self.prefills
            cached = ([p.start for p in spans], [p.length for p in spans],
                      [p.context_len for p in spans], [p.block_table for p in spans])
            object.__setattr__(self, "_prefill_args", cached)
        return cached

    @property
    def num_decodes(self) -> int:
        return int(self.decode_rows.numel())

    def decode_masked_out(self, width: int, window: int | None = None) -> torch.Tensor:
        """:func:`decode_masked_out` of the decode rows (for layers of this
        ``window``), made once per step rather than once per layer."""
        masks = self.__dict__.setdefault("_masked_out", {})
        cached = masks.get(window)
        if cached is None or cached.shape[-1] != width:
            cached = masks[window] = decode_masked_out(self.decode_lens, width, window)
        return cached


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, *, stored: bool = False,
                    window: int | None = None, softcap: float | None = None
                    ) -> torch.Tensor:
    """Causal attention of the step's queries over their sequences' cached keys.

    q [T, H, D]; k, v [T, Hkv, D] (this step's, already rotated); caches
    [NBtotal, BS, Hkv, D]. Returns [T, H, D]. Writes k, v into the caches first,
    unless ``stored`` (the rotation wrote them already). ``window``: each query
    sees its last ``window`` tokens only (itself included; sliding-window
    layers); ``softcap``: scores are soft-capped (see
    :mod:`formcast.engine.kernels.paged_attention`).
    """
    if not stored:
        store_kv_(k_cache, v_cache, k, v, meta.slot_mapping)
    t, h, d = q.shape
    if meta.batch_invariant:
        if q.is_cuda:
            return _invariant_attention_cuda(q, k_cache, v_cache, meta, scale, window, softcap)
        return _invariant_attention(q, k_cache, v_cache, meta, scale, window, softcap)
    out = q.new_empty(t, h, d)
    if meta.num_decodes:
        only_decodes = meta.num_decodes == t  # rows are then 0..T-1 in order (the runner's layout)
        tables = meta.decode_block_tables
        width = tables.shape[1] * k_cache.shape[1]
        masked_out = None if q.is_cuda else meta.decode_masked_out(width, window)
        o = paged_decode_attention(q if only_decodes else q[meta.decode_rows], k_cache, v_cache,
                                   tables, meta.decode_lens, scale, masked_out=masked_out,
                                   window=window, softcap=softcap)
        if only_decodes:
            return o
        out[meta.decode_rows] = o
    paged_prefill_attention_(out, q, k_cache, v_cache, *meta.prefill_args(), scale, k=k, v=v,
                             packed=meta.prefill_packed, window=window, softcap=softcap)
    return out


def _invariant_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata, scale: float, window: int | None,
                         softcap: float | None) -> torch.Tensor:
    """:func:`paged_attention` in batch-invariant mode (keys and values stored)."""
    t, h, d = q.shape
    out = q.new_empty(t, h, d)
    if meta.num_decodes:
        only_decodes = meta.num_decodes == t
        width = decode_width(meta.decode_block_tables, k_cache.shape[1])
        masks = meta.__dict__.setdefault("_invariant_masked", {})  # once a step, not a layer
        masked = masks.get((width, window))
        if masked is None:
            masked = masks[width, window] = decode_masked_keys(meta.decode_lens,
                                                               k_cache.shape[2], width, window)
        o = invariant_decode_attention(q if only_decodes else q[meta.decode_rows], k_cache,
                                       v_cache, meta.decode_block_tables, meta.decode_lens,
                                       scale, masked_out=masked, softcap=softcap)
        if only_decodes:
            return o
        out[meta.decode_rows] = o
    if meta.prefills:
        args = meta.prefill_args()
        chunk_masks = meta.__dict__.setdefault("_invariant_prefill_masked", {})
        masks = chunk_masks.get(window)
        if masks is None:  # (once a step, not a layer)
            masks = chunk_masks[window] = prefill_masked_keys(
                args[1], args[2], h // k_cache.shape[2], window, q.device)
        invariant_prefill_attention_(out, q, k_cache, v_cache, *args, scale, window=window,
                                     softcap=softcap, masks=masks)
    return out


def _invariant_attention_cuda(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: AttentionMetadata, scale: float, window: int | None,
                              softcap: float | None) -> torch.Tensor:
    """Batch-invariant mode on CUDA: every row, prompt rows included, as a decode
    row at its position on the one fixed-configuration Triton kernel."""
    from formcast.engine.kernels.paged_attention_triton import invariant_decode_attention_triton

    t = q.shape[0]
    if not meta.prefills:
        rows = meta.decode_rows
        o = invariant_decode_attention_triton(q if meta.num_decodes == t else q[rows], k_cache,
                                              v_cache, meta.decode_block_tables,
                                              meta.decode_lens, scale, window=window,
                                              softcap=softcap)
        if meta.num_decodes == t:
            return o
        out = q.new_zeros(q.shape)
        out[rows] = o
        return out
    rows_t, tables, lens_t = _invariant_rows(meta, q.device)
    out = q.new_zeros(q.shape)
    out[rows_t] = invariant_decode_attention_triton(q[rows_t], k_cache, v_cache, tables,
                                                    lens_t, scale, window=window,
                                                    softcap=softcap)
    return out


def _invariant_rows(meta: AttentionMetadata, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every row of the step as a decode row: its flat row, block table and context
    length (position + 1), decode rows first; made once a step, not once a layer."""
    cached = meta.__dict__.get("_invariant_rows")
    if cached is not None:
        return cached
    starts, lengths, contexts, block_tables = meta.prefill_args()
    rows = [r for s, n in zip(starts, lengths) for r in range(s, s + n)]
    lens = [p + 1 for c, n in zip(contexts, lengths) for p in range(c - n, c)]
    packed = meta.prefill_packed
    tables = packed[1] if packed is not None else \
        torch.nn.utils.rnn.pad_sequence(list(block_tables), batch_first=True)
    tables = tables.repeat_interleave(torch.tensor(lengths, device=device), dim=0)
    rows_t = torch.tensor(rows, device=device)
    lens_t = torch.tensor(lens, device=device)
    if meta.num_decodes:  # decode and prompt rows in one launch, tables padded alike
        dec = meta.decode_block_tables
        width = max(dec.shape[1], tables.shape[1])
        tables = torch.cat([_pad_tables(dec, width), _pad_tables(tables, width)])
        rows_t = torch.cat([meta.decode_rows, rows_t])
        lens_t = torch.cat([meta.decode_lens, lens_t])
    cached = (rows_t, tables, lens_t)
    object.__setattr__(meta, "_invariant_rows", cached)
    return cached


def _pad_tables(tables: torch.Tensor, width: int) -> torch.Tensor:
    """Block tables [B, NB] padded with block 0 to ``width`` columns."""
    return torch.nn.functional.pad(tables, (0, width - tables.shape[1]))


def invariant_rope_attention(qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
                             positions: torch.Tensor, rotary, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                             window: int | None) -> torch.Tensor:
    """Batch-invariant mode on CUDA for a layer whose heads the fused rope-and-attend
    kernel takes: every row, prompt rows included, through that one kernel as a
    decode row at its position (its cached context in tiles from the first key,
    then its own key), with one configuration and no split for every batch, so a
    token gets the same bits in a prompt chunk, a decode step or a verification
    step. ``qkv`` [T, (H + 2 Hkv) D] unrotated; ``rotary`` the layer's
    :class:`~formcast.engine.layers.rotary.RotaryEmbedding` (its tables). Triton
    only (CUDA, or its interpreter on the CPU). A step of one new
    token a sequence is that kernel alone; any other step first stores every
    row's rotated key and value (rows of a sequence attend to each other's),
    rotating a copy. Returns [T, H, D]."""
    from formcast.engine.kernels.paged_attention_triton import rope_decode_attention_triton

    t = qkv.shape[0]
    d = k_cache.shape[3]
    cos, sin = rotary.tables(qkv.device)
    if meta.one_token_rows and not meta.prefills and meta.num_decodes == t:
        meta.rely_on_one_token_rows()
        tables, lens = meta.decode_block_tables, meta.decode_lens
    else:
        qk = qkv[:, :(num_heads + num_kv_heads) * d].clone().view(t, num_heads + num_kv_heads, d)
        v = qkv[:, (num_heads + num_kv_heads) * d:].view(t, num_kv_heads, d)
        apply_rope_and_store_kv_(qk, v, positions, cos, sin, k_cache, v_cache, meta.slot_mapping,
                                 backend="triton")
        tables, lens = _flat_rows(meta, qkv.device)
    return rope_decode_attention_triton(qkv, num_heads, num_kv_heads, positions, cos, sin,
                                        k_cache, v_cache, meta.slot_mapping, tables, lens,
                                        scale, window=window, invariant=True)


def _flat_rows(meta: AttentionMetadata, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's block table and context length (position + 1), in the step's row
    order; made once a step, not once a layer."""
    cached = meta.__dict__.get("_invariant_flat")
    if cached is not None:
        return cached
    rows, tables, lens = _invariant_rows(meta, device) if meta.prefills else \
        (meta.decode_rows, meta.decode_block_tables, meta.decode_lens)
    t = int(meta.slot_mapping.shape[0])
    flat_tables = tables.new_zeros(t, tables.shape[1])
    flat_lens = lens.new_ones(t)
    flat_tables[rows] = tables
    flat_lens[rows] = lens
    cached = (flat_tables, flat_lens)
    object.__setattr__(meta, "_invariant_flat", cached)
    return cached
