"""Decode steps replayed from CUDA graphs.

A decode step (every row one token: plain decodes and draft positions) runs the
same kernels whatever its contents, so it is captured once per batch size of a
ladder (1, 2, 4, 8, ...) at start-up and replayed: one launch instead of a few
hundred, which is most of a small model's step time at small batches. A step of
``n`` rows replays the smallest captured size ``>= n``; the padding rows write
their keys to a scratch slot past the cache blocks the block manager owns and
attend to it alone, and their logits are dropped.

Inputs live in one device buffer (token ids, positions, cache slots, context
lengths, block tables) filled from one pinned host buffer with two
non-blocking copies. Block tables are as wide as the longest context the engine
admits; attention reads a row's table only up to its length, so stale entries
past it are harmless.
"""

from __future__ import annotations

import torch

from formcast.engine.layers.attention import AttentionMetadata


def graph_ladder(max_rows: int) -> tuple[int, ...]:
    """Batch sizes to capture: powers of two up to the first one ``>= max_rows``."""
    sizes = [1]
    while sizes[-1] < max_rows:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)


class DecodeGraphs:
    """CUDA graphs of ``model``'s decode step (hidden states through the head) at
    ``sizes`` rows, over ``kv_caches`` whose last block is scratch."""

    def __init__(self, model, kv_caches: list[torch.Tensor], *, sizes: tuple[int, ...],
                 max_blocks: int, block_size: int, scratch_slot: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = tuple(sorted(sizes))
        self.max_rows = self.sizes[-1]
        self.max_blocks = max_blocks
        self.scratch_slot = scratch_slot
        self.scratch_block = scratch_slot // block_size
        device = kv_caches[0].device
        m = self.max_rows
        n = 4 * m + m * max_blocks
        self._host = torch.zeros(n, dtype=torch.long, pin_memory=True)
        self._host_np = self._host.numpy()
        self._dev = torch.zeros(n, dtype=torch.long, device=device)
        self._tables_np = self._host_np[4 * m:].reshape(m, max_blocks)
        self._rows = torch.arange(m, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self.replays = 0  # steps served from a graph
        self._copied = torch.cuda.Event()  # the host buffer is free again once it fires
        self._reset_padding(0, m)
        self._dev.copy_(self._host)
        self._capture()

    def _inputs(self, b: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        m, dev = self.max_rows, self._dev
        meta = AttentionMetadata(
            slot_mapping=dev[2 * m:2 * m + b], decode_rows=self._rows[:b],
            decode_block_tables=dev[4 * m:].view(m, self.max_blocks)[:b],
            decode_lens=dev[3 * m:3 * m + b], prefills=())
        return dev[:b], dev[m:m + b], meta

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        torch.cuda.synchronize()
        for b in reversed(self.sizes):  # largest first: the smaller ones reuse its memory
            tokens, positions, meta = self._inputs(b)
            self._forward(tokens, positions, meta)  # compiles the kernels for this size
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[b] = self._forward(tokens, positions, meta)
            pool = graph.pool()
            self._graphs[b] = graph
        torch.cuda.synchronize()

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        return self.model.logits(self.model(tokens, positions, self.kv_caches, meta))

    def _reset_padding(self, start: int, stop: int | None = None) -> None:
        """Padding rows ``start:stop``: token 0 at position 0, keys to the scratch
        slot, attending to that slot alone (table entry 0 holds it)."""
        m, h = self.max_rows, self._host_np
        stop = m if stop is None else stop
        h[start:stop] = 0
        h[m + start:m + stop] = 0
        h[2 * m + start:2 * m + stop] = self.scratch_slot
        h[3 * m + start:3 * m + stop] = 1
        self._tables_np[start:stop, 0] = self.scratch_block

    def size_for(self, rows: int) -> int | None:
        """The captured size a step of ``rows`` decode rows replays, or None."""
        for b in self.sizes:
            if b >= rows:
                return b
        return None

    def run(self, tokens: list[int] | torch.Tensor, positions: list[int], slots: list[int],
            tables: list[list[int]], lens: list[int]) -> torch.Tensor:
        """Logits ``[n, V]`` float32 of ``n`` decode rows (a view into the graph's
        output, valid until the next replay). ``tokens`` may be a device tensor (the
        last step's samples, never seen by the host)."""
        n = len(positions)
        b = self.size_for(n)
        m, h = self.max_rows, self._host_np
        self._copied.synchronize()  # the last step's copies have read the host buffer
        on_device = isinstance(tokens, torch.Tensor)
        if not on_device:
            h[:n] = tokens
        h[m:m + n] = positions
        h[2 * m:2 * m + n] = slots
        h[3 * m:3 * m + n] = lens
        self._reset_padding(n, b)
        for i, table in enumerate(tables):
            self._tables_np[i, :len(table)] = table
        self._dev[:4 * m].copy_(self._host[:4 * m], non_blocking=True)
        width = b * self.max_blocks
        self._dev[4 * m:4 * m + width].copy_(self._host[4 * m:4 * m + width], non_blocking=True)
        if on_device:
            self._dev[:n].copy_(tokens)
        self._copied.record()
        self._graphs[b].replay()
        self.replays += 1
        return self._logits[b][:n]
