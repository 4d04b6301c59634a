"""Decode steps replayed from CUDA graphs.

A decode step (every row one token: plain decodes and draft positions) runs the
same kernels whatever its contents, so it is captured once per batch size of a
ladder (1, 2, 4, 8, ...) at start-up and replayed: one launch instead of a few
hundred, which is most of a small model's step time at small batches. A step of
``n`` rows replays the smallest captured size ``>= n``; the padding rows write
their keys to a scratch slot past the cache blocks the block manager owns and
attend to it alone, and their logits are dropped.

Inputs live in one device buffer (token ids, positions, cache slots, context
lengths, block tables) filled from one pinned host buffer with one
non-blocking copy. Block tables are as wide as the longest context the engine
admits; attention reads a row's table only up to its length, so stale entries
past it are harmless.

Each graph also samples greedily (argmax and dead-end flag, one reduction), so a
step of unconstrained greedy rows needs no sampling launches of its own.

Every size is captured twice (``copies``), each copy with outputs of its own,
and replays alternate between the copies: a step's logits stay valid through
the next step's replay. The asynchronous engine reads them then, to resample
under its mask a row whose unmasked greedy pick the grammar refused. A replay
launched ahead and then dropped gives its copy back (:meth:`DecodeGraphs.rewind`).
Graphs that share a memory pool may keep intermediates where another one keeps
its outputs, so each copy has a pool of its own, shared by its sizes.

In steady decoding the host buffer is kept from step to step
(:class:`DecodeStaging`): the same requests in the same rows only move one
position on, so a step writes positions, lengths and slots as whole arrays and
a table entry only for a row that opened a block, rather than every row's
table; rows of requests that finished are dropped by one gather. The device's
tables are kept the same way: a step's copy carries the rows' arrays and the
table entries written since the last copy as patches, which the graph scatters
into its tables first, rather than every table (a megabyte a step at a large
batch, against kilobytes).
"""

from __future__ import annotations

import numpy as np
import torch

from formcast.engine.kernels import current_stream, wait_event
from formcast.engine.kernels.sampling import greedy_picks
from formcast.engine.layers.attention import AttentionMetadata



def graph_ladder(max_rows: int) -> tuple[int, ...]:
    """Batch sizes to capture: powers of two up to the first one ``>= max_rows``."""
    sizes = [1]
    while sizes[-1] < max_rows:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)


class DecodeStaging:
    """The host buffer of a decode graph's inputs, ``max_rows`` rows: token ids,
    positions, cache slots, context lengths, table patches (``patches`` flat
    table indices, then their values), then the block tables (``max_rows`` x
    ``max_blocks``, and one entry more that unused patches write), as one long
    tensor (pinned when ``pin``).

    :meth:`upload` says how much of it a step copies to the device: the rows'
    arrays and patches only, while the device's tables are those of the last
    copy but for the entries written since (patched), else the tables too.

    :meth:`stage` writes a step from explicit lists; :meth:`stage_seqs` from the
    sequences themselves, reusing what the last :meth:`stage_seqs` wrote: a row
    keeps its table entries for as long as it holds the same sequence, so only
    the entries a sequence gained since are written. That is valid while tables
    only grow between calls (steady decoding); anything else calls
    :meth:`invalidate` first (:meth:`stage` does).
    """

    def __init__(self, max_rows: int, max_blocks: int, *, block_size: int, scratch_slot: int,
                 pin: bool) -> None:
        m = self.max_rows = max_rows
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.scratch_slot = scratch_slot
        p = self.patches = max(m, 16)  # (a step opens about m / block_size blocks)
        self.tables_at = 4 * m + 2 * p  # where the tables start
        self.host = torch.zeros(self.tables_at + m * max_blocks + 1, dtype=torch.long,
                                pin_memory=pin)
        h = self.host.numpy()
        self.tokens, self.positions = h[:m], h[m:2 * m]
        self.slots, self.lens = h[2 * m:3 * m], h[3 * m:4 * m]
        self.patch_at, self.patch_values = h[4 * m:4 * m + p], h[4 * m + p:self.tables_at]
        self.tables = h[self.tables_at:-1].reshape(m, max_blocks)
        self._rows: list | None = None               # each row's sequence
        self._table_len = np.zeros(m, dtype=np.int64)  # entries written for that sequence
        self._patched_at: list[int] = []      # table entries written since the copy (flat
        self._patched_values: list[int] = []  # indices into the tables) and their values
        self._device_rows = 0  # the device's tables are the host's below this row, patched
        self.patch_at[:] = m * max_blocks
        self.pad(0, m)

    def invalidate(self) -> None:
        self._rows = None
        self._device_rows = 0

    def forget_device(self) -> None:
        """The device's tables may have missed patches (an upload that no replay
        applied): the next upload copies the tables whole."""
        self._device_rows = 0

    def pad(self, start: int, stop: int) -> None:
        """Rows ``start:stop`` as padding: token 0 at position 0, keys to the
        scratch slot, attending to that slot alone (table entry 0 holds it)."""
        self.tokens[start:stop] = 0
        self.positions[start:stop] = 0
        self.slots[start:stop] = self.scratch_slot
        self.lens[start:stop] = 1
        first = self.tables[start:stop, 0]
        scratch = self.scratch_slot // self.block_size
        if start < self._device_rows and (first[:self._device_rows - start] != scratch).any():
            self._device_rows = start  # (rows that held a request: copied again)
        first[:] = scratch

    def upload(self, rows: int) -> int:
        """How much of :attr:`host` (a prefix) to copy to the device for a step
        of ``rows`` rows: the rows' arrays and the patches of the table entries
        written since the last copy, or the tables of those rows too when the
        device's are not the host's but for those (rows moved, more patches than
        fit, rows past those copied last). Writes the patches; unused ones
        write the spare entry past the tables."""
        spare = self.max_rows * self.max_blocks
        at, values = self._patched_at, self._patched_values
        self._patched_at, self._patched_values = [], []
        if rows > self._device_rows or len(at) > self.patches:
            self.patch_at[:] = spare
            self._device_rows = rows
            return self.tables_at + rows * self.max_blocks
        k = len(at)
        if k:
            self.patch_at[:k], self.patch_values[:k] = at, values
        self.patch_at[k:] = spare
        return self.tables_at

    def stage(self, tokens: list[int] | None, positions: list[int], slots: list[int],
              tables: list[list[int]], lens: list[int], padded: int) -> None:
        """Rows from lists (``tokens`` None: they come from the device), padding up
        to ``padded`` rows."""
        self.invalidate()
        n = len(positions)
        if tokens is not None:
            self.tokens[:n] = tokens
        self.positions[:n] = positions
        self.slots[:n] = slots
        self.lens[:n] = lens
        for i, table in enumerate(tables):
            self.tables[i, :len(table)] = table
        self.pad(n, padded)

    def stage_seqs(self, seqs: list, padded: int, ahead: int = 0) -> None:
        """Rows for ``seqs``, each decoding at its ``num_computed_tokens`` (plus
        ``ahead``) over its ``block_table`` (tokens come from the device), padding
        up to ``padded``."""
        n, bs = len(seqs), self.block_size
        # (sequences compare by identity: in steady decoding the rows stay, and the
        # lists compare in C, lengths first)
        if self._rows is None or seqs != self._rows:
            # rows move: gather what each sequence's old row holds; new ones start empty
            old = {} if self._rows is None else {id(r): i for i, r in enumerate(self._rows)}
            src = np.fromiter((old.get(id(r), -1) for r in seqs), dtype=np.int64, count=n)
            kept = src >= 0
            width = int(self._table_len[src[kept]].max(initial=0))
            self.tables[:n][kept, :width] = self.tables[src[kept], :width]
            self._table_len[:n] = np.where(kept, self._table_len[src], 0)
            self._rows = list(seqs)
            self._device_rows = 0  # (the tables moved: copied whole)
        pos = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=n)
        if ahead:
            pos += ahead
        block = pos // bs
        grown = np.flatnonzero(block >= self._table_len[:n])
        if len(grown):
            self._write_entries(seqs, grown, block, pos)
        self.positions[:n] = pos
        self.lens[:n] = pos + 1
        self.slots[:n] = self.tables[np.arange(n), block] * bs + pos % bs
        self.pad(n, padded)

    def _write_entries(self, seqs: list, grown: np.ndarray, block: np.ndarray,
                       pos: np.ndarray) -> None:
        """Write the table entries that the sequences of rows ``grown`` gained since
        the last call. Rows that decode together open a block at the same step
        (256 rows: 256 entries at once), so the usual call, one entry a row, is
        written in a few array operations."""
        tables = [seqs[i].block_table for i in grown.tolist()]
        lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
        short = np.flatnonzero(block[grown] >= lens)
        if len(short):
            i = int(grown[short[0]])
            raise RuntimeError(f"sequence {seqs[i].request_id}: no KV block allocated for "
                               f"position {pos[i]}")
        start = self._table_len[grown]
        if (lens - start == 1).all():
            values = np.fromiter((t[-1] for t in tables), dtype=np.int64, count=len(tables))
            self.tables[grown, start] = values
            at, rows_of = grown * self.max_blocks + start, grown
        else:  # (a row that gained more than one entry: one at a time)
            at_list, value_list = [], []
            for i, table, first in zip(grown.tolist(), tables, start.tolist()):
                self.tables[i, first:len(table)] = table[first:]
                at_list += range(i * self.max_blocks + first, i * self.max_blocks + len(table))
                value_list += table[first:]
            at, values = np.array(at_list, dtype=np.int64), np.array(value_list, dtype=np.int64)
            rows_of = at // self.max_blocks
        self._table_len[grown] = lens
        if self._device_rows:  # (the device's copies of those rows: patched)
            on_device = rows_of < self._device_rows
            self._patched_at += at[on_device].tolist()
            self._patched_values += values[on_device].tolist()


class DecodeGraphs:
    """CUDA graphs of ``model``'s decode step (hidden states through the head) at
    ``sizes`` rows, over ``kv_caches`` whose last block is scratch."""

    def __init__(self, model, kv_caches: list[torch.Tensor], *, sizes: tuple[int, ...],
                 max_blocks: int, block_size: int, scratch_slot: int,
                 sample_vocab: int | None = None, copies: int = 2,
                 batch_invariant: bool = False) -> None:
        """``sample_vocab``: the logits columns greedy sampling may pick (the
        tokenizer's vocabulary; default all); ``copies``: captures of each size,
        replayed in turn (see the module doc)."""
        self.model = model
        self.copies = copies
        self.batch_invariant = batch_invariant  # (captured over the invariant attention)
        self.sample_vocab = sample_vocab
        self.kv_caches = kv_caches
        self.sizes = tuple(sorted(sizes))
        self.max_rows = self.sizes[-1]
        self.max_blocks = max_blocks
        device = kv_caches[0].device
        m = self.max_rows
        self.staging = DecodeStaging(m, max_blocks, block_size=block_size,
                                     scratch_slot=scratch_slot, pin=True)
        self._dev = torch.zeros_like(self.staging.host, device=device)
        self._rows = torch.arange(m, device=device)
        # per size, ``copies`` copies (see the module doc); replays take them in turn
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._logits: dict[int, list[torch.Tensor]] = {}
        self._greedy: dict[int, list[torch.Tensor]] = {}
        self._copy = 0  # the copy the last replay ran
        self._last = 0  # the size the last replay ran
        self._before = 0  # the size the replay before it ran
        self.replays = 0  # steps served from a graph
        self.greedy_reads = 0  # of them, steps whose tokens the graph sampled
        self.staged_replays = 0  # of them, steps staged ahead (see stage_ahead)
        self.preloaded_replays = 0  # of those, steps whose copies were queued ahead (preload)
        # the sizes whose graphs a step with draft positions (several rows of a
        # sequence) may replay: not those whose forward relied on one row a sequence
        self.draft_sizes: set[int] = set()
        self._copied = torch.cuda.Event()  # the host buffer is free again once it fires
        self._staged: tuple | None = None  # (rows, size) staged ahead (see stage_ahead)
        self._preloaded = False  # the staged step's copies are queued (see preload)
        self._unapplied = False  # an upload is queued that no replay has applied
        self._dev.copy_(self.staging.host)
        self._capture()

    def _inputs(self, b: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        m, dev, at = self.max_rows, self._dev, self.staging.tables_at
        meta = AttentionMetadata(
            slot_mapping=dev[2 * m:2 * m + b], decode_rows=self._rows[:b],
            decode_block_tables=dev[at:-1].view(m, self.max_blocks)[:b],
            decode_lens=dev[3 * m:3 * m + b], prefills=(), one_token_rows=True,
            batch_invariant=self.batch_invariant)
        return dev[:b], dev[m:m + b], meta

    def _patch(self) -> None:
        """The step's table patches into the device's tables (in the graph)."""
        m, p, at = self.max_rows, self.staging.patches, self.staging.tables_at
        self._dev[at:].scatter_(0, self._dev[4 * m:4 * m + p], self._dev[4 * m + p:at])

    @torch.inference_mode()
    def _capture(self) -> None:
        # one memory pool per copy, shared by its sizes (largest first: the smaller
        # ones reuse its memory). A graph's outputs may lie where another graph of
        # its pool keeps intermediates, so only a replay of the same copy may
        # overwrite them, which comes ``copies`` replays later
        pools: list = [None] * self.copies
        torch.cuda.synchronize()
        for b in reversed(self.sizes):
            tokens, positions, meta = self._inputs(b)
            self._patch()
            self._forward(tokens, positions, meta)  # compiles the kernels for this size
            # (a forward that stores a row's key and value as other rows attend gives
            # draft rows stale keys: steps with drafts run eagerly at such sizes)
            if not meta.relied_on_one_token_rows:
                self.draft_sizes.add(b)
            torch.cuda.synchronize()
            self._graphs[b], self._logits[b], self._greedy[b] = [], [], []
            for c in range(self.copies):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pools[c]):
                    self._patch()
                    logits = self._forward(tokens, positions, meta)
                    greedy = greedy_picks(logits, self.sample_vocab)  # sampled in the graph
                pools[c] = graph.pool()
                self._graphs[b].append(graph)
                self._logits[b].append(logits)
                self._greedy[b].append(greedy)
        torch.cuda.synchronize()

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        return self.model.logits(self.model(tokens, positions, self.kv_caches, meta))

    def size_for(self, rows: int) -> int | None:
        """The captured size a step of ``rows`` decode rows replays, or None."""
        for b in self.sizes:
            if b >= rows:
                return b
        return None

    def run(self, tokens: list[int] | torch.Tensor, positions: list[int], slots: list[int],
            tables: list[list[int]], lens: list[int]) -> torch.Tensor:
        """Logits ``[n, V]`` float32 of ``n`` decode rows (a view into the graph's
        output, valid through the next replay). ``tokens`` may be a device tensor (the
        last step's samples, never seen by the host)."""
        n = len(positions)
        b = self.size_for(n)
        wait_event(self._copied)  # the last step's copies have read the host buffer
        self._staged, self._preloaded = None, False  # (stage() copies the tables whole)
        on_device = isinstance(tokens, torch.Tensor)
        self.staging.stage(None if on_device else tokens, positions, slots, tables, lens, b)
        return self._replay(n, b, tokens if on_device else None)

    def run_seqs(self, seqs: list, tokens: torch.Tensor, *, staged: bool = False
                 ) -> torch.Tensor:
        """:meth:`run` for ``seqs`` decoding at their ``num_computed_tokens``, their
        input tokens ``tokens`` [n] on the device, the host buffer kept from the
        last call (:meth:`DecodeStaging.stage_seqs`). ``staged``: the caller
        knows :meth:`stage_ahead` staged this very step for ``seqs`` (its rows
        advanced by the one token it assumed), the last thing staged."""
        n = len(seqs)
        b = self.size_for(n)
        ahead, self._staged = self._staged, None
        preloaded, self._preloaded = self._preloaded, False
        hit = staged and ahead is not None and ahead[1] == b and ahead[0] is seqs
        if hit and preloaded:  # (its copies are queued, behind the replay in flight)
            self.staged_replays += 1
            self.preloaded_replays += 1
            return self._replay(n, b, None, copied=True)
        wait_event(self._copied)
        if hit:
            self.staged_replays += 1
        else:
            self.staging.stage_seqs(seqs, b)
        return self._replay(n, b, tokens)

    def stage_ahead(self, seqs: list) -> bool:
        """Stage the decode step of ``seqs`` one token past their
        ``num_computed_tokens`` (whose KV blocks must be allocated), for a
        :meth:`run_seqs` of the same list once they advanced by it: the host's
        part of that step done while it waits for something else. False when
        no graph serves that many rows."""
        n = len(seqs)
        b = self.size_for(n)
        if b is None:
            return False
        wait_event(self._copied)  # (the replay in flight has read the host buffer)
        self._preloaded = False  # (a step staged before, preloaded or not, is dropped)
        self.staging.stage_seqs(seqs, b, ahead=1)
        self._staged = (seqs, b)
        return True

    def preload(self, tokens: torch.Tensor) -> bool:
        """Queue the copies of the step :meth:`stage_ahead` staged (its inputs, and
        its input ``tokens`` [n] on the device) now, rather than when it launches:
        the stream runs them after the replay in flight, and the launch, when
        :meth:`run_seqs` comes for that step with ``staged`` and nothing else
        replayed or staged since, is the replay alone. The asynchronous engine
        preloads while it waits for the grammar's verdicts on the picks the step
        takes as input, which decide whether it launches: the launch after the
        verdicts is what the device waits for. The price: when the step does
        not launch as staged after all (a refused pick), the step that runs
        instead stages into the host buffer the queued copy reads, so its launch
        waits for the replay in flight to end. False (nothing queued) when
        nothing is staged or it is preloaded already."""
        staged = self._staged
        if staged is None or self._preloaded:
            return False
        seqs, b = staged
        self._copy_inputs(len(seqs), b, tokens)
        self._preloaded = self._unapplied = True
        return True

    def invalidate(self) -> None:
        """Something other than steady decoding changed the sequences' tables."""
        self._staged, self._preloaded = None, False
        self.staging.invalidate()

    def _copy_inputs(self, n: int, b: int, tokens: torch.Tensor | None) -> None:
        """The host buffer's part for a step of ``b`` rows (the rows' inputs and
        patches, and the tables when they must go: one copy), then the first
        ``n`` rows' ``tokens`` from the device, queued on the stream. After an
        upload that no replay applied (a preload not taken), the tables go whole:
        the patches it carried never reached the device's tables."""
        if self._unapplied:
            self.staging.forget_device()
            self._unapplied = False
        end = self.staging.upload(b)
        try:
            self._dev[:end].copy_(self.staging.host[:end], non_blocking=True)
            if tokens is not None:
                self._dev[:n].copy_(tokens)
            self._copied.record(current_stream(self._dev.device))
        except BaseException:
            self.staging.invalidate()  # (its patches may not have reached the device)
            raise

    def _replay(self, n: int, b: int, tokens: torch.Tensor | None, *, copied: bool = False
                ) -> torch.Tensor:
        """``copied``: the inputs are queued already (:meth:`preload`)."""
        if not copied:
            self._copy_inputs(n, b, tokens)
        try:
            self._copy = (self._copy + 1) % self.copies
            self._graphs[b][self._copy].replay()
        except BaseException:
            self.staging.invalidate()  # (its patches may not have reached the device)
            raise
        self._unapplied = False  # (a preload's upload, now applied)
        self._last, self._before = b, self._last
        self.replays += 1
        return self._logits[b][self._copy][:n]

    def rewind(self, replays: int) -> None:
        """Forget the replay that made the count ``replays`` when it is still the last
        one (its output unread): the next replay takes its copy, so the replay
        before keeps its logits for as long as it would have without it."""
        if self.replays == replays:
            self._copy = (self._copy - 1) % self.copies
            self._last = self._before
            self.replays -= 1

    def greedy(self, n: int) -> torch.Tensor:
        """``[2, n]`` long on the device: the last replay's greedy tokens and dead-end
        flags of its first ``n`` rows, as :meth:`Sampler.sample_on_device` gives them
        for unmasked greedy rows (valid through the next replay)."""
        self.greedy_reads += 1
        return self._greedy[self._last][self._copy][:, :n]
