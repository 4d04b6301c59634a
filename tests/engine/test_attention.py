"""Paged attention: verification rows and batched decodes equal one-row decoding, bit for bit."""

from __future__ import annotations

import pytest
import torch

from formcast.engine.layers.attention import AttentionMetadata, PrefillSpan, paged_attention

H, HKV, D, BS, NB = 9, 3, 64, 16, 48


def _decode_meta(slot: int, table: torch.Tensor, n: int) -> AttentionMetadata:
    blocks = -(-n // BS)
    return AttentionMetadata(
        slot_mapping=torch.tensor([slot]), decode_rows=torch.tensor([0]),
        decode_block_tables=table[:blocks].view(1, -1),
        decode_lens=torch.tensor([n]), prefills=())


@pytest.mark.parametrize("start", [1, 15, 16, 17, 130, 301])
@pytest.mark.parametrize("length", [2, 5, 8])
def test_verification_rows_equal_decodes_bit_for_bit(start: int, length: int) -> None:
    """A decode and its draft positions, run as decode rows of one step (each with
    its own context length, as the model runner builds them), give each position
    exactly what decoding the tokens one step at a time gives."""
    gen = torch.Generator().manual_seed(start * 10 + length)
    k_cache = torch.randn(NB, BS, HKV, D, generator=gen)
    v_cache = torch.randn(NB, BS, HKV, D, generator=gen)
    table = torch.randperm(NB, generator=gen)[:-(-(start + length) // BS)]
    q = torch.randn(length, H, D, generator=gen)
    k = torch.randn(length, HKV, D, generator=gen)
    v = torch.randn(length, HKV, D, generator=gen)
    slots = torch.tensor([int(table[p // BS]) * BS + p % BS for p in range(start, start + length)])

    lens = [start + i + 1 for i in range(length)]
    width = -(-lens[-1] // BS)
    kc, vc = k_cache.clone(), v_cache.clone()
    meta = AttentionMetadata(
        slot_mapping=slots, decode_rows=torch.arange(length),
        decode_block_tables=table[:width].expand(length, width),
        decode_lens=torch.tensor(lens), prefills=())
    together = paged_attention(q, k, v, kc, vc, meta, D ** -0.5)

    kc, vc = k_cache.clone(), v_cache.clone()
    for i in range(length):
        one = paged_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], kc, vc,
                              _decode_meta(int(slots[i]), table, start + i + 1), D ** -0.5)
        assert torch.equal(one[0], together[i]), f"row {i} differs from its decode"

    # and it is still causal attention: close to the prefill path
    kc, vc = k_cache.clone(), v_cache.clone()
    causal = paged_attention(q, k, v, kc, vc, AttentionMetadata(
        slot_mapping=slots, decode_rows=torch.zeros(0, dtype=torch.long),
        decode_block_tables=torch.zeros(0, 0, dtype=torch.long),
        decode_lens=torch.zeros(0, dtype=torch.long),
        prefills=(PrefillSpan(start=0, length=length, context_len=start + length,
                              block_table=table),)), D ** -0.5)
    torch.testing.assert_close(together, causal, rtol=1e-5, atol=1e-5)

def test_decode_rows_do_not_depend_on_the_batch() -> None:
    """A decode row's output is bit for bit its one-row result, whatever else is in
    the batch and however far the batch's longest context pads it (batch invariance:
    the same request gives the same tokens in any company)."""
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(NB * 4, BS, HKV, D, generator=gen)
    v_cache = torch.randn(NB * 4, BS, HKV, D, generator=gen)
    for trial in range(6):
        lens = [int(x) for x in torch.randint(1, 300, (2 + trial,), generator=gen)]
        # disjoint blocks: no row's new key lands in another row's context
        free = torch.randperm(NB * 4, generator=gen).tolist()
        tables = []
        for n in lens:
            tables.append(torch.tensor(free[:-(-n // BS)]))
            del free[:-(-n // BS)]
        q = torch.randn(len(lens), H, D, generator=gen)
        k = torch.randn(len(lens), HKV, D, generator=gen)
        v = torch.randn(len(lens), HKV, D, generator=gen)
        slots = torch.tensor([int(t[(n - 1) // BS]) * BS + (n - 1) % BS
                              for t, n in zip(tables, lens)])
        width = max(len(t) for t in tables)
        padded = torch.stack([torch.cat([t, t.new_zeros(width - len(t))]) for t in tables])
        meta = AttentionMetadata(
            slot_mapping=slots, decode_rows=torch.arange(len(lens)), decode_block_tables=padded,
            decode_lens=torch.tensor(lens), prefills=())
        batched = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, D ** -0.5)
        for i, n in enumerate(lens):
            alone = paged_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], k_cache.clone(),
                                    v_cache.clone(), _decode_meta(int(slots[i]), tables[i], n),
                                    D ** -0.5)
            assert torch.equal(alone[0], batched[i]), f"trial {trial}: row {i} of {len(lens)}"
