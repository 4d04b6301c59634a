"""Turns a scheduled batch into tensors, runs the model, returns logits.

Owns the KV cache memory: one tensor per layer, ``[2, NBtotal, BS, Hkv, D]``
(keys then values), ``NBtotal`` the blocks of the layer's KV group
(:mod:`formcast.engine.kv_groups`: a model with sliding-window layers has a pool
and a block table a sequence for each kind). Batch tensors are built on the host
and moved once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from formcast.engine.config import LlamaConfig
from formcast.engine.cuda_graph import DecodeGraphs
from formcast.engine.kernels import to_device
from formcast.engine.kernels.paged_attention import pack_prefills
from formcast.engine.kv_groups import KVGroup
from formcast.engine.layers.attention import AttentionMetadata, PrefillSpan
from formcast.engine.layers.quant import prompt_rows
from formcast.engine.models.llama import LlamaForCausalLM
from formcast.engine.prefill_graph import PrefillGraphs
from formcast.engine.scheduler import ScheduledSeq
from formcast.engine.sequence import Sequence
from formcast.engine.tuning import EngineTuning


def kv_bytes_per_block(config: LlamaConfig, block_size: int, dtype: torch.dtype) -> int:
    return config.num_hidden_layers * layer_block_bytes(config, block_size, dtype)


def layer_block_bytes(config: LlamaConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block of one layer (keys and values)."""
    elem = torch.empty(0, dtype=dtype).element_size()
    return 2 * block_size * config.num_key_value_heads * config.head_dim * elem


def zeroed_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV cache tensor. On the CPU its pages come from the kernel already
    zeroed and are committed as they are first written (numpy's calloc), so a cache
    sized for the longest requests costs resident memory only for the blocks used."""
    if device.type == "cpu" and dtype in (torch.float32, torch.float16):
        return torch.from_numpy(np.zeros(shape, dtype=np.float32 if dtype == torch.float32
                                         else np.float16))
    return torch.zeros(shape, dtype=dtype, device=device)


@dataclass(kw_only=True)
class StepLayout:
    """A step's rows as host lists, in batch order (what ``_prepare`` moves to the device)."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    is_prompt: list[bool] = field(default_factory=list)
    decode_rows: list[int] = field(default_factory=list)
    decode_tables: list[list[int]] = field(default_factory=list)
    decode_lens: list[int] = field(default_factory=list)
    prefills: list[tuple[int, int, int, list[int]]] = field(default_factory=list)
    # (first row, tokens, context length once written, block table) per prefill chunk
    drafts: bool = False  # a sequence decodes several rows (its draft positions)

    def add_decode(self, token: int | None, position: int, table: list[int],
                   is_prompt: bool, block_size: int) -> None:
        """A row decoding one token at ``position`` over the blocks ``table``
        (``token`` None: it is on the device, not in this layout)."""
        row = len(self.positions)
        if token is not None:
            self.tokens.append(token)
        self.positions.append(position)
        self.is_prompt.append(is_prompt)
        self.slots.append(table[position // block_size] * block_size + position % block_size)
        self.decode_rows.append(row)
        self.decode_tables.append(table[:position // block_size + 1])
        self.decode_lens.append(position + 1)
        self.sample_rows.append(row)

    @property
    def only_decodes(self) -> bool:
        return not self.prefills and len(self.sample_rows) == len(self.tokens)


def _invariant_linears(model: torch.nn.Module, on: bool) -> None:
    """Whether every :class:`Linear` of ``model`` runs its CUDA rows on the
    fixed-tile GEMM (a model's setting: the last runner built over it decides)."""
    from formcast.engine.layers.linear import Linear

    for module in model.modules():
        if isinstance(module, Linear):
            module.batch_invariant = on


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, *, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype,
                 cuda_graph_sizes: tuple[int, ...] = (), max_model_len: int | None = None,
                 sample_vocab: int | None = None, max_prefill_tokens: int = 0,
                 max_prefill_chunks: int = 0, tuning: EngineTuning | None = None,
                 kv_groups: tuple[KVGroup, ...] | None = None,
                 batch_invariant: bool = False) -> None:
        """``kv_groups``: the layers' KV groups, sized (None: one group of every
        layer, full attention, ``num_blocks`` blocks); graphs serve that case only.
        ``cuda_graph_sizes``: batch sizes whose decode steps are captured as CUDA
        graphs (CUDA only; empty: none); ``max_model_len`` bounds their block tables;
        ``sample_vocab``: the columns the graphs' greedy sampling may pick;
        ``max_prefill_tokens``, ``max_prefill_chunks``: the largest prompt step that
        graphs serve as well (:class:`PrefillGraphs`; 0: none; with decode graphs);
        ``batch_invariant``: attention by the batch-invariant kernels (CPU; see
        :class:`formcast.engine.layers.attention.AttentionMetadata`)."""
        tuning = tuning or EngineTuning()
        self.model = model
        if device.type == "cuda":
            _invariant_linears(model, batch_invariant)
        # On CUDA in bfloat16 a Llama model's norm weights fold into the projections
        # after them (LlamaForCausalLM.fold_norms) before graphs are captured: fewer
        # kernels a decode layer. (bfloat16 only: the folded projections work on the raw residual stream,
        # rms(x) times larger, which float16's range may not hold; and never a model
        # another runner holds, whose captured graphs read its weights' memory)
        if tuning.fold_norms and device.type == "cuda" and dtype == torch.bfloat16 and \
                hasattr(model, "fold_norms") and not getattr(model, "_run", False):
            model.fold_norms()
        model._run = True
        self.device = device
        self.dtype = dtype
        self.batch_invariant = batch_invariant
        self.block_size = block_size
        self.num_blocks = num_blocks
        cfg = model.config
        if kv_groups is None:
            kv_groups = (KVGroup(window=None, layers=tuple(range(cfg.num_hidden_layers)),
                                 num_blocks=num_blocks),)
        self.kv_groups = kv_groups
        # one layout and metadata per group, each layer reading its group's
        self.grouped = len(kv_groups) > 1 or kv_groups[0].window is not None
        self._layer_group = [0] * cfg.num_hidden_layers
        for g, group in enumerate(kv_groups):
            for layer in group.layers:
                self._layer_group[layer] = g
        graphs = bool(cuda_graph_sizes) and device.type == "cuda"
        if graphs and self.grouped:
            raise ValueError("CUDA graphs serve full-attention models only (one KV group)")
        # with graphs, one block more: padding rows write their keys there
        self.kv_caches = [
            zeroed_cache((2, kv_groups[self._layer_group[i]].num_blocks + graphs, block_size,
                          cfg.num_key_value_heads, cfg.head_dim), dtype, device)
            for i in range(cfg.num_hidden_layers)
        ]
        self.graphs: DecodeGraphs | None = None
        if graphs:
            max_len = max_model_len or cfg.max_position_embeddings
            self.graphs = DecodeGraphs(model, self.kv_caches, sizes=cuda_graph_sizes,
                                       max_blocks=-(-max_len // block_size),
                                       block_size=block_size,
                                       scratch_slot=num_blocks * block_size,
                                       sample_vocab=sample_vocab, copies=tuning.graph_copies,
                                       batch_invariant=batch_invariant)
        self.prefill_graphs: PrefillGraphs | None = None
        # (not in batch-invariant mode: its prompt rows attend as decode rows, from
        # host lists a captured graph cannot follow)
        if graphs and max_prefill_tokens and max_prefill_chunks and not batch_invariant:
            self.prefill_graphs = PrefillGraphs(
                model, self.kv_caches, max_tokens=max_prefill_tokens,
                max_chunks=max_prefill_chunks, max_blocks=self.graphs.max_blocks,
                scratch_slot=num_blocks * block_size, min_rows=tuning.prefill_graph_min_rows,
                most_tokens=tuning.prefill_graph_max_tokens)
        self._replayed = False  # the last execute_decode replayed a graph

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq], *, all_logits: bool = False,
                prompt_float: bool = True, rows: list[int] | None = None) -> torch.Tensor:
        """Run one step. Returns float32 logits ``[N, V]``: one row per sequence whose
        chunk reaches its end, plus one per draft token after it (in batch order), or
        every token's row if ``all_logits``, or the rows of the step's tokens ``rows``.

        Rows of prompt tokens run on a quantized model's float32 weights
        (:func:`formcast.engine.layers.quant.prompt_rows`) unless ``prompt_float`` is
        False. Decode steps replay a CUDA graph when one fits (the logits are then a
        view valid through the next decode step), and so do steps of prompt chunks
        alone (a view that the next such step overwrites)."""
        layout = self._layout(batch)
        self._replayed = False
        if self.graphs is not None:
            self.graphs.invalidate()  # ordinary steps may cut and regrow block tables
        size = self.graphs.size_for(len(layout.tokens)) if self.graphs is not None else None
        if size is not None and layout.only_decodes \
                and (not layout.drafts or size in self.graphs.draft_sizes):
            logits = self.graphs.run(layout.tokens, layout.positions, layout.slots,
                                     layout.decode_tables, layout.decode_lens)
            return logits.clone() if all_logits else logits
        if self.prefill_graphs is not None and layout.prefills and not layout.decode_rows \
                and not all_logits and rows is None:
            logits = self.prefill_graphs.run(layout.tokens, layout.positions, layout.slots,
                                             layout.prefills, layout.sample_rows)
            if logits is not None:
                return logits
        token_ids, positions, meta, sample_rows = self._prepare(layout)
        if self.grouped:
            meta = self._layer_metas(meta, [self._layout(batch, g)
                                            for g in range(1, len(self.kv_groups))])
        is_prompt = layout.is_prompt
        if rows is not None:
            sample_rows = to_device(rows, torch.long, token_ids.device)
        elif not all_logits:
            rows = layout.sample_rows
        head_is_prompt = is_prompt if rows is None else [is_prompt[r] for r in rows]
        if not prompt_float:
            is_prompt = head_is_prompt = None
        with prompt_rows(is_prompt, self.device):
            hidden = self.model(token_ids, positions, self.kv_caches, meta)   # [T, E]
        if rows is not None:
            hidden = hidden[sample_rows]
        with prompt_rows(head_is_prompt, self.device):
            return self.model.logits(hidden)

    @torch.inference_mode()
    def execute_decode(self, seqs: list[Sequence], tokens: torch.Tensor, *,
                       staged: bool = False) -> torch.Tensor:
        """One decode row per sequence, its input token taken from ``tokens`` [B] on
        the device (the previous step's samples: the host need not have them yet), at
        position ``seq.num_computed_tokens``, whose KV block must be allocated.
        ``staged``: :meth:`stage_decode_ahead` staged this step for ``seqs`` (the
        same list), which then advanced by one token, and nothing ran since.
        Returns float32 logits ``[B, V]`` (a graph's output view when one ran)."""
        self._replayed = self.graphs is not None and self.graphs.size_for(len(seqs)) is not None
        if self._replayed:
            return self.graphs.run_seqs(seqs, tokens, staged=staged)
        layouts = []
        for g in range(len(self.kv_groups)):
            layout = StepLayout()
            for seq in seqs:
                p = seq.num_computed_tokens
                layout.add_decode(None, p, seq.block_table if g == 0 else seq.group_tables[g - 1],
                                  p < seq.num_prompt_tokens, self.block_size)
            layouts.append(layout)
        layout = layouts[0]
        _, pos, meta, _ = self._prepare(layout)
        if self.grouped:
            meta = self._layer_metas(meta, layouts[1:])
        with prompt_rows(layout.is_prompt, self.device):
            hidden = self.model(tokens, pos, self.kv_caches, meta)
            return self.model.logits(hidden)

    def stage_decode_ahead(self, seqs: list[Sequence]) -> bool:
        """Stage the host's part of :meth:`execute_decode` for ``seqs`` one token
        past their ``num_computed_tokens`` (its KV blocks allocated), while they
        have yet to advance by it; False when no decode graph serves it (then
        :meth:`execute_decode` does it all)."""
        return self.graphs is not None and self.graphs.stage_ahead(seqs)

    def preload_decode(self, tokens: torch.Tensor) -> bool:
        """Queue the input copies of the step :meth:`stage_decode_ahead` staged, its
        input tokens ``tokens`` on the device, now rather than at its launch (see
        :meth:`DecodeGraphs.preload`); its :meth:`execute_decode` with ``staged``
        then only replays. False when nothing was queued."""
        return self.graphs is not None and self.graphs.preload(tokens)

    def forget_rows(self) -> None:
        """No request is left: the decode graphs' staging lets go of the sequences
        it keeps for their block tables (the next step stages its rows whole)."""
        if self.graphs is not None:
            self.graphs.invalidate()

    def decode_mark(self) -> int:
        """Where the decode graphs' replays stand (for :meth:`rewind_decode`)."""
        return self.graphs.replays if self.graphs is not None else 0

    def rewind_decode(self, mark: int) -> None:
        """Drop the output of the :meth:`execute_decode` made right after
        :meth:`decode_mark` gave ``mark``, unread: when it replayed a graph and no
        replay came since, the next replay overwrites it rather than the logits of
        the step before, which stay valid through the next replay as ever."""
        if self.graphs is not None:
            self.graphs.rewind(mark + 1)

    def greedy_samples(self, n: int) -> torch.Tensor | None:
        """The last :meth:`execute_decode`'s greedy tokens and dead-end flags ``[2, n]``
        sampled inside its graph (unmasked logits), or None when no graph ran."""
        return self.graphs.greedy(n) if self._replayed else None

    def copy_blocks(self, copies: list[list[tuple[int, int]]]) -> None:
        """Copy KV blocks: ``copies[g]`` the (source, destination) pairs of group ``g``."""
        for layer, cache in enumerate(self.kv_caches):
            pairs = copies[self._layer_group[layer]]
            if pairs:
                src, dst = (torch.tensor(ids, device=cache.device) for ids in zip(*pairs))
                cache[:, dst] = cache[:, src]

    def release(self, seq: Sequence) -> None:
        """Nothing to free: a sequence's KV blocks belong to the block manager."""

    def _layer_metas(self, first: AttentionMetadata, others: list[StepLayout]
                     ) -> list[AttentionMetadata]:
        """Each layer's metadata, over its group's block tables (``first``: the
        first group's; ``others``: the layouts of the other groups). The layers
        mask their own windows."""
        metas = [first] + [self._metadata(layout) for layout in others]
        return [metas[g] for g in self._layer_group]

    def _layout(self, batch: list[ScheduledSeq], group: int = 0) -> StepLayout:
        """The step's rows over the block tables of KV group ``group``."""
        bs = self.block_size
        out = StepLayout()
        tokens = out.tokens
        for item in batch:
            seq, n, d = item.seq, item.num_tokens, item.num_draft
            start = seq.num_computed_tokens
            row0 = len(tokens)
            if n == 1 and not d and start == len(seq.token_ids) - 1:
                # a plain decode (most rows of most steps): the general case, unrolled
                out.add_decode(seq.token_ids[start], start,
                               seq.block_table if not group else seq.group_tables[group - 1],
                               start < seq.num_prompt_tokens, bs)
                continue
            tokens.extend(seq.token_ids[start:start + n - d])
            if d:
                tokens.extend(seq.draft.tokens[:d])
            pos = range(start, start + n)
            out.positions.extend(pos)
            out.is_prompt.extend(p < seq.num_prompt_tokens for p in pos)
            table = seq.block_table if not group else seq.group_tables[group - 1]
            out.slots.extend(table[p // bs] * bs + p % bs for p in pos)
            if n == d + 1:
                # a decode, and each draft position after it as a decode of its own:
                # verification scores every position exactly as plain decoding of
                # those tokens would (decode rows are batch-invariant, and so are
                # the linears), so greedy output cannot change with speculation
                out.drafts = out.drafts or n > 1
                for j in range(n):
                    out.decode_rows.append(row0 + j)
                    out.decode_tables.append(table[:(start + j + bs) // bs])
                    out.decode_lens.append(start + j + 1)
            else:
                nblocks = -(-(start + n) // bs)
                out.prefills.append((row0, n, start + n, table[:nblocks]))
            if item.samples:
                out.sample_rows.extend(range(row0 + n - 1 - d, row0 + n))
        return out

    def _prepare(self, layout: StepLayout
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        dev = self.device
        return (to_device(layout.tokens, torch.long, dev),
                to_device(layout.positions, torch.long, dev), self._metadata(layout),
                to_device(layout.sample_rows, torch.long, dev))

    def _metadata(self, layout: StepLayout) -> AttentionMetadata:
        """The attention metadata of ``layout``'s rows over its tables."""
        dev = self.device
        tables = layout.decode_tables
        max_blocks = max((len(t) for t in tables), default=0)
        padded = [t + [0] * (max_blocks - len(t)) for t in tables]
        spans, packed = (), None
        if layout.prefills:
            # every chunk's table in one padded tensor, one copy for the step
            starts, lengths, contexts, ptables = zip(*layout.prefills)
            packed = pack_prefills(list(starts), list(lengths), list(contexts), ptables, dev)
            rows = packed[1].unbind(0)  # (one call for every chunk's row)
            spans = tuple(PrefillSpan(start=row0, length=n, context_len=ctx,
                                      block_table=row[:len(table)])
                          for row, (row0, n, ctx, table) in zip(rows, layout.prefills))
        return AttentionMetadata(
            slot_mapping=to_device(layout.slots, torch.long, dev),
            decode_rows=to_device(layout.decode_rows, torch.long, dev),
            decode_block_tables=to_device(padded, torch.long, dev).view(len(padded), max_blocks),
            decode_lens=to_device(layout.decode_lens, torch.long, dev),
            prefills=spans, prefill_packed=packed, one_token_rows=not layout.drafts,
            batch_invariant=self.batch_invariant,
        )
