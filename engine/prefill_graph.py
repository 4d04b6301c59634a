"""Prompt steps replayed from CUDA graphs.

A step of prompt chunks runs eagerly as a few hundred kernel launches, and for a
small model the host's dispatch of them is the step's time, several times the
device's work. So a step made only of prompt
chunks (no decode rows, no draft positions) replays a graph instead, captured the
first time a step of its bucket runs: the step's tokens padded up to a power of
two (16 at least), its chunks too, and its longest chunk (which sizes the
attention kernel's grid) too. Padding tokens write their keys to the scratch slot
the decode graphs use; padding chunks are empty and the attention kernel skips
them. The linears run on the padded row count (their results per row may round
differently than eager ones of another row count would, as between any two
batch sizes); every other kernel works row by row.

Inputs live in one device buffer (tokens, positions, cache slots, chunk starts,
lengths and context lengths, the rows to sample, block tables) filled from one
pinned host buffer in one copy. Every graph writes the logits of the rows it
samples into one output buffer, so a bucket's graph holds no memory of its own
but the kernels' (the graphs share one memory pool): those logits are valid
until the next prompt step.

Buckets are captured as they come, at most ``max_graphs`` of them, up to
``most_tokens`` tokens (a step of an uncaptured bucket past that runs eagerly). A
capture runs the step eagerly once (compiling kernels for its shapes), captures
it, then replays it: a few times a step's cost, once per bucket. It is captured
in thread-local mode, so the mask thread's CUDA calls (pinned buffers, events)
are not caught in it. A bucket whose capture fails keeps the eager run's logits
for that step and runs eagerly from then on.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from formcast.engine.kernels import current_stream, wait_event
from formcast.engine.layers.attention import AttentionMetadata, PrefillSpan



def _bucket(n: int, floor: int = 1) -> int:
    """The power of two ``>= max(n, floor)``."""
    return 1 << (max(n, floor) - 1).bit_length()


@dataclass(frozen=True)
class _Bucket:
    tokens: int  # rows of the step, padded
    chunks: int  # prompt chunks, padded
    longest: int  # the longest chunk, padded (the attention grid)


class PrefillGraphs:
    """CUDA graphs of ``model``'s prompt steps over ``kv_caches`` (whose scratch slot
    is ``scratch_slot``), up to ``max_tokens`` rows (at most ``most_tokens``) and
    ``max_chunks`` chunks a step, block tables up to ``max_blocks`` wide."""

    def __init__(self, model, kv_caches: list[torch.Tensor], *, max_tokens: int,
                 max_chunks: int, max_blocks: int, scratch_slot: int,
                 max_graphs: int = 16, min_rows: int = 16, most_tokens: int = 8192) -> None:
        # min_rows: the smallest padded step; most_tokens: the largest step served
        # (the shared pool keeps its activations)
        self.model = model
        self.kv_caches = kv_caches
        self.min_rows = min_rows
        self.max_tokens = _bucket(min(max_tokens, most_tokens), min_rows)
        self.max_chunks = _bucket(max_chunks)
        self.max_blocks = max_blocks
        self.scratch_slot = scratch_slot
        self.max_graphs = max_graphs
        t, p = self.max_tokens, self.max_chunks
        # [tokens | positions | slots] t each, [starts | lengths | contexts | samples] p
        # each, then the tables p x max_blocks
        self._size = 3 * t + 4 * p + p * max_blocks
        device = kv_caches[0].device
        self._host = torch.zeros(self._size, dtype=torch.long, pin_memory=True)
        self._dev = torch.zeros(self._size, dtype=torch.long, device=device)
        h = self._host.numpy()
        self._tokens, self._positions, self._slots = h[:t], h[t:2 * t], h[2 * t:3 * t]
        self._chunks = h[3 * t:3 * t + 3 * p].reshape(3, p)
        self._samples = h[3 * t + 3 * p:3 * t + 4 * p]
        self._tables = h[3 * t + 4 * p:].reshape(p, max_blocks)
        self._copied = torch.cuda.Event()  # the host buffer is free again once it fires
        self._graphs: dict[_Bucket, torch.cuda.CUDAGraph] = {}
        self._failed: dict[_Bucket, str] = {}  # buckets whose capture failed, and why
        self._pool = None
        self._logits: torch.Tensor | None = None  # [max_chunks, V] float32, once captured
        self.replays = 0
        self.captures = 0

    @property
    def buckets(self) -> frozenset:
        """The buckets captured so far (each replays its graph)."""
        return frozenset(self._graphs)

    @property
    def failures(self) -> dict:
        """The buckets whose capture failed, and why (a copy; they run eagerly)."""
        return dict(self._failed)

    def bucket_for(self, num_tokens: int, lengths: list[int], num_samples: int
                   ) -> _Bucket | None:
        """The bucket of a prompt step, or None when it is too large for one."""
        if num_tokens > self.max_tokens or len(lengths) > self.max_chunks \
                or num_samples > len(lengths):
            return None
        tokens = _bucket(num_tokens, self.min_rows)
        return _Bucket(tokens, _bucket(len(lengths)),
                       min(tokens, _bucket(max(lengths), self.min_rows)))

    def run(self, tokens: list[int], positions: list[int], slots: list[int],
            prefills: list[tuple[int, int, int, list[int]]], sample_rows: list[int]
            ) -> torch.Tensor | None:
        """Logits ``[len(sample_rows), V]`` float32 of a prompt step (``prefills``:
        each chunk's first row, length, context length once written and block
        table), replayed from its bucket's graph (captured now if it is new), or
        None when the step has no graph (the caller runs it eagerly). The logits
        are a view, valid until the next call."""
        starts, lengths, contexts, tables = zip(*prefills)
        key = self.bucket_for(len(tokens), lengths, len(sample_rows))
        if key is None or key in self._failed or (
                key not in self._graphs and len(self._graphs) >= self.max_graphs) \
                or max(map(len, tables)) > self.max_blocks:
            return None
        self._stage(key, tokens, positions, slots, (starts, lengths, contexts, tables),
                    sample_rows)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(key)
            if graph is None:  # (the eager run before the capture is this step's result)
                return self._logits[:len(sample_rows)]
        graph.replay()
        self.replays += 1
        return self._logits[:len(sample_rows)]

    def _stage(self, key: _Bucket, tokens, positions, slots, chunks, sample_rows) -> None:
        """Write a step into the host buffer (``chunks``: the starts, lengths,
        context lengths and tables of its prompt chunks) and start its copy."""
        n, t, p = len(tokens), key.tokens, key.chunks
        wait_event(self._copied)  # the last step's copy has read the host buffer
        self._tokens[:n] = tokens
        self._tokens[n:t] = 0
        self._positions[:n] = positions
        self._positions[n:t] = 0
        self._slots[:n] = slots
        self._slots[n:t] = self.scratch_slot
        starts, lengths, contexts, tables = chunks
        c = len(starts)
        self._chunks[0, :c], self._chunks[1, :c], self._chunks[2, :c] = starts, lengths, contexts
        self._chunks[:, c:p] = 0  # empty chunks: nothing to attend, nothing written
        self._samples[:len(sample_rows)] = sample_rows
        self._samples[len(sample_rows):p] = 0
        rows = self._tables
        for i, table in enumerate(tables):
            rows[i, :len(table)] = table
        self._dev.copy_(self._host, non_blocking=True)
        self._copied.record(current_stream(self._dev.device))

    def _inputs(self, key: _Bucket) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                             torch.Tensor]:
        t, p, dev = self.max_tokens, self.max_chunks, self._dev
        n, c = key.tokens, key.chunks
        chunks = dev[3 * t:3 * t + 3 * p].view(3, p)[:, :c]
        tables = dev[3 * t + 4 * p:].view(p, self.max_blocks)[:c]
        empty = dev[:0]
        # the spans' lists only size the attention grid (the longest chunk): the
        # kernel reads the chunks from ``prefill_packed``
        spans = (PrefillSpan(start=0, length=key.longest, context_len=key.longest,
                             block_table=tables[0]),)
        meta = AttentionMetadata(slot_mapping=dev[2 * t:2 * t + n], decode_rows=empty,
                                 decode_block_tables=empty.view(0, 0), decode_lens=empty,
                                 prefills=spans, prefill_packed=(chunks, tables))
        samples = dev[3 * t + 3 * p:3 * t + 3 * p + c]
        return dev[:n], dev[t:t + n], meta, samples

    def _forward(self, key: _Bucket) -> None:
        tokens, positions, meta, samples = self._inputs(key)
        hidden = self.model(tokens, positions, self.kv_caches, meta)
        logits = self.model.logits(hidden[samples])
        if self._logits is None:
            self._logits = torch.empty(self.max_chunks, logits.shape[1], dtype=logits.dtype,
                                       device=logits.device)
        self._logits[:key.chunks].copy_(logits)

    def _capture(self, key: _Bucket) -> torch.cuda.CUDAGraph | None:
        """Run the staged step eagerly (compiling its kernels; its logits are
        written), then capture it; None (the bucket then always runs eagerly)
        when capturing fails."""
        self._forward(key)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._forward(key)
        except Exception as exc:  # (an op that cannot be captured: eager from now on)
            self._failed[key] = f"{type(exc).__name__}: {exc}"
            return None
        self._pool = graph.pool()
        self._graphs[key] = graph
        self.captures += 1
        return graph
