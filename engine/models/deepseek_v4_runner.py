"""Runs DeepSeek-V4 for the engine over per-sequence states instead of paged KV blocks.

:class:`DeepseekV4Runner` has :class:`~formcast.engine.model_runner.ModelRunner`'s
``execute`` contract. It owns one :class:`DeepseekV4State` per request (by request
id): a chunk starting at ``num_computed_tokens == 0`` gets a fresh one (a new
request, or one preempted and recomputed); otherwise, before the chunk runs, the
state is brought in line with ``seq.num_computed_tokens``. The engine moves that
count back when verification rejects draft tokens or a constraint dead end is
backed out of; the runner then truncates the state (up to ``max_rollback`` tokens),
or restores its latest snapshot at or before the target and recomputes the tokens
from there (farther rollbacks). Snapshots are taken every ``snapshot_interval``
committed tokens and cost no tensor copies (states replace tensors, never write
into them).

Its state cannot be shared between requests, so the engine runs this model with
prefix caching off; the block manager still admits requests (its blocks count
tokens, sized by :func:`state_bytes_per_token`) but no KV memory sits behind them.

For the MTP drafter the runner also keeps each request's main-model streams at
the positions its MTP layer has not consumed yet (``keep_hidden``). The MTP layer
runs lazily, when a draft is asked for (:meth:`mtp_logits`): position ``p`` needs
token ``p + 1``, and only committed tokens are ever fed to it, so a rejected draft
never enters the MTP state; rollbacks truncate the MTP part with the rest.

Legend: ``T`` tokens of the step, ``N`` hc streams, ``E`` hidden size, ``V`` vocab,
``P`` pending MTP positions of one request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from formcast.engine.config import DeepseekV4Config
from formcast.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from formcast.engine.models.deepseek_v4_state import DeepseekV4Snapshot, DeepseekV4State
from formcast.engine.scheduler import ScheduledSeq
from formcast.engine.sequence import Sequence


def state_bytes_per_token(config: DeepseekV4Config, dtype: torch.dtype) -> int:
    """Bytes a request's state grows by per token: the compressed entries (and the
    indexer's keys on CSA layers). Windows and raw rows are a fixed cost per request
    (:func:`state_bytes_per_sequence`)."""
    elem = torch.empty(0, dtype=dtype).element_size()
    per_token = 0.0
    for i, kind in enumerate(config.layer_types):
        rate = config.compress_rate(i)
        if rate:
            per_token += config.head_dim / rate
        if kind == "compressed_sparse_attention":
            per_token += config.index_head_dim / rate
    return max(1, int(per_token * elem + 0.5))


def state_bytes_per_sequence(config: DeepseekV4Config, dtype: torch.dtype, max_rollback: int) -> int:
    """Fixed bytes of one request's state: sliding windows (main and MTP layers) and
    the compressors' raw rows."""
    elem = torch.empty(0, dtype=dtype).element_size()
    window = (config.sliding_window - 1 + max_rollback) * config.head_dim
    total = window * (config.num_hidden_layers + config.num_nextn_predict_layers)
    for i, kind in enumerate(config.layer_types):
        rate = config.compress_rate(i)
        if kind == "compressed_sparse_attention":  # overlapping: 2 windows, 2x width, kv + gate
            total += 2 * (2 * rate + max_rollback) * 2 * (config.head_dim + config.index_head_dim)
        elif rate:
            total += 2 * (rate + max_rollback) * config.head_dim
    return total * elem


@dataclass
class RunnerStats:
    """What the runner did to keep states in line with the engine (for tests and logs)."""

    truncations: int = 0              # states rolled back in place
    truncated_tokens: int = 0
    truncations_across_compression: int = 0  # of them, ones that dropped compressed entries
    restores: int = 0                 # rollbacks past max_rollback: snapshot (or scratch) + recompute
    recomputed_tokens: int = 0
    mtp_positions: int = 0            # positions run through the MTP layer


@dataclass
class _Track:
    """One request's state, the streams its MTP layer has yet to read, snapshots."""

    state: DeepseekV4State
    hidden: torch.Tensor | None  # [P, N, E]: positions state.mtp_num_tokens .. num_tokens - 1
    snapshots: list[tuple[DeepseekV4Snapshot, torch.Tensor | None]] = field(default_factory=list)
    draft: tuple[int, torch.Tensor] | None = None  # (position, MTP logits [V]) last drafted


class DeepseekV4Runner:
    """Per-request states for :class:`DeepseekV4ForCausalLM` behind the engine's runner contract.

    Parameters
    ----------
    model : DeepseekV4ForCausalLM
    max_rollback : int
        Tokens a state can be truncated by in place; must cover the longest draft
        verified in one step (the engine passes ``spec.max_draft + 1`` or more).
    snapshot_interval : int
        Committed tokens between two snapshots of a request's state.
    keep_snapshots : int
        Snapshots kept per request (the most recent ones).
    keep_hidden : bool
        Keep the streams the MTP layer needs (turn on when the MTP layer drafts).
    max_pending : int
        Streams kept per request before the MTP layer reads them without being asked
        (a long prompt, or a request that is not drafted for: bounded memory).
    batch_invariant : bool
        Run the model in batch-invariant mode
        (:meth:`DeepseekV4ForCausalLM.set_batch_invariant`): a request's logits do not
        depend on the requests, chunks or drafts it shares a step with.
    """

    def __init__(self, model: DeepseekV4ForCausalLM, *, max_rollback: int = 16,
                 snapshot_interval: int = 64, keep_snapshots: int = 2,
                 keep_hidden: bool = False, max_pending: int = 256,
                 batch_invariant: bool = False) -> None:
        if max_rollback < 1 or snapshot_interval < 1 or keep_snapshots < 0:
            raise ValueError(f"need max_rollback >= 1, snapshot_interval >= 1 and keep_snapshots >= 0, "
                             f"got {max_rollback}, {snapshot_interval}, {keep_snapshots}")
        if keep_hidden and not len(model.mtp):
            raise ValueError("keep_hidden serves the MTP layer, but this model has none")
        self.model = model
        model.set_batch_invariant(batch_invariant)  # (a model's setting: the last runner decides)
        self.batch_invariant = batch_invariant
        self.max_rollback = max_rollback
        self.snapshot_interval = snapshot_interval
        self.keep_snapshots = keep_snapshots
        self.keep_hidden = keep_hidden
        self.max_pending = max_pending
        self.stats = RunnerStats()
        self._tracks: dict[str, _Track] = {}
        self._rates = [model.config.compress_rate(i) for i in range(model.config.num_hidden_layers)]

    @property
    def num_states(self) -> int:
        """Requests holding a state right now."""
        return len(self._tracks)

    # -- the engine's contract ---------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq], *, all_logits: bool = False,
                prompt_float: bool = True) -> torch.Tensor:
        """Run one step. Returns float32 logits ``[M, V]``: one row per sequence whose
        chunk reaches its end plus one per draft token after it (batch order), or
        every token's row if ``all_logits``. Advances each sequence's state by its
        whole chunk (draft tokens included; rejected ones are truncated next time)."""
        device = self.model.model.embed_tokens.weight.device
        tokens: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        tracks: list[_Track] = []
        lengths: list[int] = []
        for item in batch:
            seq, n, d = item.seq, item.num_tokens, item.num_draft
            track = self._sync(seq)
            start = seq.num_computed_tokens
            row0 = len(tokens)
            tokens.extend(seq.token_ids[start:start + n - d])
            if d:
                tokens.extend(seq.draft.tokens[:d])
            positions.extend(range(start, start + n))
            if item.samples:
                sample_rows.extend(range(row0 + n - 1 - d, row0 + n))
            tracks.append(track)
            lengths.append(n)
        ids = torch.tensor(tokens, dtype=torch.long, device=device)
        pos = torch.tensor(positions, dtype=torch.long, device=device)
        streams = self.model(ids, pos, [t.state for t in tracks], lengths)  # [T, N, E]
        if self.keep_hidden:
            start = 0
            for track, n in zip(tracks, lengths):
                track.hidden = torch.cat((track.hidden, streams[start:start + n]))
                start += n
        if not all_logits:
            streams = streams[torch.tensor(sample_rows, dtype=torch.long, device=device)]
        return self.model.logits(streams)

    def release(self, seq: Sequence) -> None:
        """Free the state of ``seq`` (finished, aborted or preempted); no-op if none."""
        self._tracks.pop(seq.request_id, None)

    def forget_rows(self) -> None:
        """(As :meth:`ModelRunner.forget_rows`; no rows are kept between steps here.)"""

    # -- MTP drafting --------------------------------------------------------------------

    @torch.inference_mode()
    def mtp_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        """The MTP layer's float32 logits ``[B, V]`` for the token after each sequence's
        last one (each must be in decode: exactly its last token uncomputed).

        Runs the MTP layer over every position it has not read yet, in one batch,
        advancing the MTP part of the states; asking again before the sequence moves
        on returns the same row without running anything.
        """
        if not self.keep_hidden:
            raise RuntimeError("the runner was built without keep_hidden=True; the MTP layer "
                               "has no streams to draft from")
        out: list[torch.Tensor | None] = [None] * len(seqs)
        todo: list[tuple[int, _Track, int]] = []
        for i, seq in enumerate(seqs):
            if seq.num_uncomputed_tokens != 1:
                raise ValueError(f"request {seq.request_id} is not in decode "
                                 f"({seq.num_uncomputed_tokens} uncomputed tokens)")
            track = self._sync(seq)
            k = seq.num_computed_tokens
            if track.draft is not None and track.draft[0] == k:
                out[i] = track.draft[1]
            else:
                if track.state.mtp_num_tokens >= k:
                    self._reopen_mtp(seq, track)
                todo.append((i, track, k))
        if todo:
            self._run_mtp(seqs, todo, out)
        return torch.stack(out)

    def _run_mtp(self, seqs: list[Sequence], todo: list[tuple[int, _Track, int]],
                 out: list[torch.Tensor | None]) -> None:
        device = self.model.model.embed_tokens.weight.device
        hidden, next_ids, positions, lengths = [], [], [], []
        for i, track, k in todo:
            m = track.state.mtp_num_tokens
            hidden.append(track.hidden)  # rows of positions m .. k - 1
            next_ids.extend(seqs[i].token_ids[m + 1:k + 1])
            positions.extend(range(m, k))
            lengths.append(k - m)
        logits = self.model.mtp_logits(
            torch.cat(hidden), torch.tensor(next_ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            [t.state for _, t, _ in todo], lengths)  # [sum(lengths), V]
        self.stats.mtp_positions += sum(lengths)
        end = 0
        for (i, track, k), n in zip(todo, lengths):
            end += n
            track.hidden = track.hidden[n:]
            row = logits[end - 1].clone()  # (a view would keep the whole prefill's logits)
            track.draft = (k, row)
            out[i] = row

    def _drain_mtp(self, seq: Sequence, track: _Track) -> None:
        """Run the MTP layer over the pending positions whose next token is known,
        all but the last one (kept for the next draft)."""
        m, k = track.state.mtp_num_tokens, seq.num_computed_tokens
        if k - 1 <= m:
            return
        device = self.model.model.embed_tokens.weight.device
        n = k - 1 - m
        with torch.inference_mode():
            self.model.mtp_logits(track.hidden[:n],
                                  torch.tensor(seq.token_ids[m + 1:k], dtype=torch.long, device=device),
                                  torch.arange(m, k - 1, dtype=torch.long, device=device),
                                  [track.state], [n])
        track.hidden = track.hidden[n:]
        self.stats.mtp_positions += n

    def _reopen_mtp(self, seq: Sequence, track: _Track) -> None:
        """The MTP layer already read the last position (its draft was lost to a
        rollback): truncate the state by one token and recompute it, which gives back
        the stream the MTP layer needs."""
        k = seq.num_computed_tokens
        self._truncate(track, k - 1)
        self._recompute(seq, track, k)

    # -- keeping states in line ----------------------------------------------------------

    def _sync(self, seq: Sequence) -> _Track:
        """The track of ``seq`` with its state at exactly ``seq.num_computed_tokens``."""
        target = seq.num_computed_tokens
        track = self._tracks.get(seq.request_id)
        if track is None or target == 0:
            track = self._tracks[seq.request_id] = self._new_track()
        if track.state.num_tokens > target:
            if track.state.num_tokens - target <= self.max_rollback:
                self._truncate(track, target)
            else:
                self._restore(track, target)
        if track.state.num_tokens < target:
            self._recompute(seq, track, target)
        if track.hidden is not None and track.hidden.shape[0] > self.max_pending:
            self._drain_mtp(seq, track)
        newest = track.snapshots[-1][0].num_tokens if track.snapshots else 0
        if self.keep_snapshots and target >= newest + self.snapshot_interval:
            track.snapshots.append((track.state.snapshot(), track.hidden))
            del track.snapshots[:-self.keep_snapshots]
        return track

    def _new_track(self) -> _Track:
        state = self.model.new_state(max_rollback=self.max_rollback)
        hidden = None
        if self.keep_hidden:
            emb = self.model.model.embed_tokens.weight
            hidden = emb.new_zeros(0, self.model.config.hc_mult, self.model.config.hidden_size)
        return _Track(state=state, hidden=hidden)

    def _truncate(self, track: _Track, target: int) -> None:
        state = track.state
        old, old_mtp = state.num_tokens, state.mtp_num_tokens
        if old == target:
            return
        self.stats.truncations += 1
        self.stats.truncated_tokens += old - target
        if any(rate and target // rate < old // rate for rate in self._rates):
            self.stats.truncations_across_compression += 1
        self.model.truncate_state(state, target)
        if track.hidden is not None:
            track.hidden = track.hidden[:max(0, target - old_mtp)]
        track.snapshots = [s for s in track.snapshots if s[0].num_tokens <= target]
        track.draft = None

    def _restore(self, track: _Track, target: int) -> None:
        """Back to the newest snapshot at or before ``target`` (or to an empty state);
        the caller recomputes the rest."""
        self.stats.restores += 1
        usable = [s for s in track.snapshots if s[0].num_tokens <= target]
        track.snapshots = usable
        track.draft = None
        if usable:
            snap, hidden = usable[-1]
            track.state.restore(snap)
            track.hidden = hidden
        else:
            fresh = self._new_track()
            track.state, track.hidden = fresh.state, fresh.hidden

    def _recompute(self, seq: Sequence, track: _Track, target: int) -> None:
        """Run the committed tokens from the state's end up to ``target`` on their own."""
        state = track.state
        start = state.num_tokens
        device = self.model.model.embed_tokens.weight.device
        ids = torch.tensor(seq.token_ids[start:target], dtype=torch.long, device=device)
        pos = torch.arange(start, target, dtype=torch.long, device=device)
        with torch.inference_mode():
            streams = self.model(ids, pos, [state], [target - start])
        if track.hidden is not None:
            track.hidden = torch.cat((track.hidden, streams))
        self.stats.recomputed_tokens += target - start
