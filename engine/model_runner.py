"""Turns a scheduled batch into tensors, runs the model, returns logits.

Owns the KV cache memory: one tensor per layer, ``[2, NBtotal, BS, Hkv, D]``
(keys then values). Batch tensors are built on the host and moved once.
"""

from __future__ import annotations

import torch

from formcast.engine.config import LlamaConfig
from formcast.engine.layers.attention import AttentionMetadata, PrefillSpan
from formcast.engine.layers.quant import prompt_rows
from formcast.engine.models.llama import LlamaForCausalLM
from formcast.engine.scheduler import ScheduledSeq
from formcast.engine.sequence import Sequence


def kv_bytes_per_block(config: LlamaConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty(0, dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads \
        * config.head_dim * elem


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, *, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        cfg = model.config
        self.kv_caches = [
            torch.zeros(2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
                        dtype=dtype, device=device)
            for _ in range(cfg.num_hidden_layers)
        ]

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq], *, all_logits: bool = False,
                prompt_float: bool = True) -> torch.Tensor:
        """Run one step. Returns float32 logits ``[N, V]``: one row per sequence whose
        chunk reaches its end, plus one per draft token after it (in batch order), or
        every token's row if ``all_logits``.

        Rows of prompt tokens run on a quantized model's float32 weights
        (:func:`formcast.engine.layers.quant.prompt_rows`) unless ``prompt_float`` is
        False."""
        token_ids, positions, meta, sample_rows, is_prompt, head_is_prompt = self._prepare(batch)
        if all_logits:
            head_is_prompt = is_prompt
        if not prompt_float:
            is_prompt = head_is_prompt = None
        with prompt_rows(is_prompt, self.device):
            hidden = self.model(token_ids, positions, self.kv_caches, meta)   # [T, E]
        if not all_logits:
            hidden = hidden[sample_rows]
        with prompt_rows(head_is_prompt, self.device):
            return self.model.logits(hidden)

    def release(self, seq: Sequence) -> None:
        """Nothing to free: a sequence's KV blocks belong to the block manager."""

    def _prepare(self, batch: list[ScheduledSeq]
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor,
                            list[bool], list[bool]]:
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        is_prompt: list[bool] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSpan] = []
        for item in batch:
            seq, n, d = item.seq, item.num_tokens, item.num_draft
            start = seq.num_computed_tokens
            row0 = len(tokens)
            tokens.extend(seq.token_ids[start:start + n - d])
            if d:
                tokens.extend(seq.draft.tokens[:d])
            pos = range(start, start + n)
            positions.extend(pos)
            is_prompt.extend(p < seq.num_prompt_tokens for p in pos)
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            if n == d + 1:
                # a decode, and each draft position after it as a decode of its own:
                # verification scores every position exactly as plain decoding of
                # those tokens would (decode rows are batch-invariant, and so are
                # the linears), so greedy output cannot change with speculation
                for j in range(n):
                    decode_rows.append(row0 + j)
                    decode_tables.append(table[:(start + j + bs) // bs])
                    decode_lens.append(start + j + 1)
            else:
                nblocks = -(-(start + n) // bs)
                prefills.append(PrefillSpan(
                    start=row0, length=n, context_len=start + n,
                    block_table=torch.tensor(table[:nblocks], dtype=torch.long,
                                             device=self.device)))
            if item.samples:
                sample_rows.extend(range(row0 + n - 1 - d, row0 + n))
        max_blocks = max((len(t) for t in decode_tables), default=0)
        padded = [t + [0] * (max_blocks - len(t)) for t in decode_tables]
        lens = torch.tensor(decode_lens, dtype=torch.long)
        mask = torch.arange(max_blocks * bs).unsqueeze(0) < lens.unsqueeze(1)  # [Bd, S]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long).to(dev, non_blocking=True),
            decode_rows=torch.tensor(decode_rows, dtype=torch.long).to(dev, non_blocking=True),
            decode_block_tables=torch.tensor(padded, dtype=torch.long).view(len(padded), max_blocks)
            .to(dev, non_blocking=True),
            decode_mask=mask.view(len(padded), 1, 1, max_blocks * bs).to(dev, non_blocking=True),
            prefills=tuple(prefills),
        )
        return (torch.tensor(tokens, dtype=torch.long).to(dev, non_blocking=True),
                torch.tensor(positions, dtype=torch.long).to(dev, non_blocking=True),
                meta,
                torch.tensor(sample_rows, dtype=torch.long).to(dev, non_blocking=True),
                is_prompt, [is_prompt[r] for r in sample_rows])
