"""DeepSeek-V4 attention: one shared key/value head over a sliding window, plus
compressed entries on CSA and HCA layers, attention sinks and a grouped low-rank
output projection.

Per query at position ``p`` the keys are
- the window: tokens ``p - sliding_window + 1 .. p`` (K = V, normed and rotated);
- compressed entries ``w`` whose source window has ended, ``(w + 1) * rate <= p + 1``:
  all of them on HCA layers, the lightning indexer's top ``index_topk`` on CSA layers;
- one learned sink logit per head that takes probability mass but adds no value.
The value read back carries the key's rotation, so the output's rotated channels are
rotated back by the query position before the output projection.

Legend: ``T`` tokens of the step, ``L`` tokens of one sequence's chunk, ``H`` heads,
``D`` head dim, ``E`` hidden size, ``n`` compressed entries, ``m`` compress rate,
``W`` raw compressor row width, ``HI``/``DI`` indexer heads/head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from formcast.engine.config import DeepseekV4Config
from formcast.engine.kernels.paged_attention_invariant import KV_SPLIT, ROW_TILE, attend_split
from formcast.engine.layers.linear import Linear
from formcast.engine.models.deepseek_v4_common import V4RMSNorm, V4Rotary, dense, rms_normalize
from formcast.engine.models.deepseek_v4_state import CompressorState, LayerState


def deterministic_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest scores per row, ties broken by the lowest index.

    scores ``[L, n]`` -> ``[L, min(k, n)]``, ordered best first. A stable descending
    sort keeps equal scores in index order, so a tie between two compressed entries
    always goes to the earlier one, whatever the chunking (``torch.topk`` leaves the
    order of ties unspecified).
    """
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[:, :min(k, scores.shape[-1])]


@dataclass(frozen=True)
class ChunkView:
    """Where one sequence's chunk sits in the step: rows ``start:start+length`` of
    the flattened tokens, its first position ``past`` (= tokens already in its state)."""

    start: int
    length: int
    past: int


class Compressor(nn.Module):
    """Pools every ``rate`` tokens into one entry of ``dim`` channels.

    Entry ``w`` is a per-channel softmax-gated sum over its slots, RMS-normed and
    rotated at position ``w * rate``. Without overlap (HCA) the slots are the window's
    ``rate`` tokens. With overlap (CSA and the indexer) each token projects to two
    halves, and entry ``w``'s slots are the first halves of window ``w - 1`` then the
    second halves of window ``w`` (width ``2 * rate``, stride ``rate``); window 0 has no
    predecessor, its first-half slots get zero weight.
    """

    def __init__(self, hidden_size: int, dim: int, rate: int, *, overlap: bool, eps: float) -> None:
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        width = 2 * dim if overlap else dim
        self.kv_proj = Linear(hidden_size, width, bias=False)
        self.gate_proj = Linear(hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32))
        self.kv_norm = V4RMSNorm(dim, eps)

    def rows_to_keep(self, max_rollback: int) -> int:
        """Raw rows a state keeps: the open window, the previous one when windows
        overlap, and ``max_rollback`` more so truncation can reopen a window."""
        return (2 if self.overlap else 1) * self.rate + max_rollback

    def empty_state(self, device: torch.device, dtype: torch.dtype) -> CompressorState:
        width = self.kv_proj.out_features
        rows = torch.zeros(0, width, device=device, dtype=dtype)
        return CompressorState(kv_rows=rows, gate_rows=rows,
                               entries=torch.zeros(0, self.dim, device=device, dtype=dtype))

    def advance(self, state: CompressorState, kv: torch.Tensor, gate: torch.Tensor, past: int,
                rotary: V4Rotary, max_rollback: int) -> CompressorState:
        """Append one chunk's raw rows ``kv, gate [L, W]`` for positions ``past..past+L-1``
        and emit the entries of every window they complete; returns the new state."""
        m, length = self.rate, kv.shape[0]
        kv_rows = torch.cat((state.kv_rows, kv))
        gate_rows = torch.cat((state.gate_rows, gate))
        first_row = past - state.kv_rows.shape[0]  # position of kv_rows[0]
        w0, w1 = past // m, (past + length) // m  # windows [w0, w1) complete in this chunk
        entries = state.entries
        if w1 > w0:
            entries = torch.cat((entries, self._pool(kv_rows, gate_rows, first_row, w0, w1, rotary)))
        keep = self.rows_to_keep(max_rollback)
        return CompressorState(kv_rows=kv_rows[-keep:], gate_rows=gate_rows[-keep:], entries=entries)

    def _pool(self, kv_rows: torch.Tensor, gate_rows: torch.Tensor, first_row: int, w0: int, w1: int,
              rotary: V4Rotary) -> torch.Tensor:
        # -> [w1 - w0, dim]: entries of windows w0..w1-1
        m, d, nw = self.rate, self.dim, w1 - w0
        gate_rows = gate_rows.float()
        bias = self.position_bias.float()

        def windows(first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
            a = first * m - first_row
            kv = kv_rows[a:a + count * m].unflatten(0, (count, m))  # [count, m, W]
            gate = gate_rows[a:a + count * m].unflatten(0, (count, m)) + bias
            return kv, gate

        kv, gate = windows(w0, nw)
        if self.overlap:
            prev_kv = kv.new_zeros(nw, m, d)
            prev_gate = gate.new_full((nw, m, d), float("-inf"))
            has_prev = 1 if w0 == 0 else 0  # window 0 has no predecessor
            if nw > has_prev:
                pkv, pgate = windows(w0 - 1 + has_prev, nw - has_prev)
                prev_kv[has_prev:], prev_gate[has_prev:] = pkv[..., :d], pgate[..., :d]
            kv = torch.cat((prev_kv, kv[..., d:]), dim=1)  # [nw, 2m, d]
            gate = torch.cat((prev_gate, gate[..., d:]), dim=1)
        weights = gate.softmax(dim=1).to(kv.dtype)
        pooled = self.kv_norm((kv * weights).sum(dim=1))  # [nw, d]
        positions = torch.arange(w0, w1, device=kv.device) * m
        cos, sin = rotary.cos_sin(positions)
        return rotary.rotate(pooled, cos, sin)


class Indexer(nn.Module):
    """Lightning indexer of a CSA layer: scores compressed entries per query,
    ``sum_h w_h(x) * relu(q_h . k_s) / sqrt(DI)``, over its own overlapping compressor."""

    # batch-invariant mode: scores by row-invariant products, heads summed in a fixed order
    batch_invariant: bool = False

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.topk = config.index_topk
        self.compressor = Compressor(config.hidden_size, self.head_dim, config.compress_rate_csa,
                                     overlap=True, eps=config.rms_norm_eps)
        self.q_b_proj = Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.weights_proj = Linear(config.hidden_size, self.num_heads, bias=False)

    def queries(self, q_residual: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rotary: V4Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """-> rotated queries ``[T, HI, DI]`` and float32 head weights ``[T, HI]``."""
        q = self.q_b_proj(q_residual).unflatten(-1, (self.num_heads, self.head_dim))
        weights = self.weights_proj(x).float() * self.num_heads ** -0.5
        return rotary.rotate(q, cos, sin), weights

    def select(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
               visible: torch.Tensor) -> torch.Tensor:
        """q ``[L, HI, DI]``, weights ``[L, HI]``, keys ``[n, DI]``, visible ``[L, n]`` ->
        bool ``[L, n]``: the visible entries among each query's top ``index_topk``."""
        if self.batch_invariant:
            scores = self._invariant_scores(q, weights, keys)
        else:
            scores = F.relu(torch.einsum("lhd,nd->lhn", q.float(), keys.float())) * self.head_dim ** -0.5
            scores = (scores * weights[..., None]).sum(dim=1)  # [L, n]
        scores = scores.masked_fill(~visible, float("-inf"))
        chosen = torch.zeros_like(visible)
        chosen.scatter_(1, deterministic_topk(scores, self.topk), True)
        return chosen & visible

    def _invariant_scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor
                          ) -> torch.Tensor:
        # select's scores [L, n], each row's bits independent of L and of n: the
        # products on row tiles, the heads added one after another
        length, n = q.shape[0], keys.shape[0]
        width = -(-n // KV_SPLIT) * KV_SPLIT
        if n == 0:
            return weights.new_zeros(length, 0)
        padded = keys.float().new_zeros(width, keys.shape[1])
        padded[:n] = keys.float()
        scores = F.relu(dense(q.float(), padded, True)[..., :n]) * self.head_dim ** -0.5
        out = scores[:, 0] * weights[:, 0, None]
        for h in range(1, self.num_heads):
            out += scores[:, h] * weights[:, h, None]
        return out


class DeepseekV4Attention(nn.Module):
    """Attention of one layer (sliding, CSA or HCA), over per-sequence states."""

    # batch-invariant mode: a row's attention and low-rank output do not depend on
    # the chunk it came in or the rows beside it (set by the runner)
    batch_invariant: bool = False

    def __init__(self, config: DeepseekV4Config, layer_type: str, rotary: V4Rotary) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.sliding_window = config.sliding_window
        self.o_groups = config.o_groups
        self.eps = config.rms_norm_eps
        self.rotary = rotary
        self.q_a_proj = Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_a_norm = V4RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.kv_proj = Linear(config.hidden_size, self.head_dim, bias=False)
        self.kv_norm = V4RMSNorm(self.head_dim, config.rms_norm_eps)
        # o_a_proj holds the o_groups per-group [o_lora_rank, H*D/o_groups] maps stacked.
        self.o_a_proj = Linear(self.num_heads * self.head_dim // config.o_groups,
                                  config.o_groups * config.o_lora_rank, bias=False)
        self.o_b_proj = Linear(config.o_groups * config.o_lora_rank, config.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32))
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if layer_type == "compressed_sparse_attention":
            self.compressor = Compressor(config.hidden_size, self.head_dim, config.compress_rate_csa,
                                         overlap=True, eps=config.rms_norm_eps)
            self.indexer = Indexer(config)
        elif layer_type == "heavily_compressed_attention":
            self.compressor = Compressor(config.hidden_size, self.head_dim, config.compress_rate_hca,
                                         overlap=False, eps=config.rms_norm_eps)

    def empty_state(self, device: torch.device, dtype: torch.dtype) -> LayerState:
        window = torch.zeros(0, self.head_dim, device=device, dtype=dtype)
        return LayerState(
            window=window,
            compressor=self.compressor.empty_state(device, dtype) if self.compressor else None,
            indexer=self.indexer.compressor.empty_state(device, dtype) if self.indexer else None)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, chunks: list[ChunkView],
                states: list[LayerState], max_rollback: int) -> tuple[torch.Tensor, list[LayerState]]:
        """x ``[T, E]``, positions ``[T]`` -> ``[T, E]`` and each chunk's new layer state."""
        cos, sin = self.rotary.cos_sin(positions)  # [T, R/2]
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_residual).unflatten(-1, (self.num_heads, self.head_dim))  # [T, H, D]
        q = self.rotary.rotate(rms_normalize(q, self.eps), cos, sin)
        kv = self.rotary.rotate(self.kv_norm(self.kv_proj(x)), cos, sin)  # [T, D]
        raw = raw_index = None
        if self.compressor is not None:
            raw = self.compressor.kv_proj(x), self.compressor.gate_proj(x)  # [T, W] each
        if self.indexer is not None:
            comp = self.indexer.compressor
            raw_index = comp.kv_proj(x), comp.gate_proj(x)
            index_q, index_w = self.indexer.queries(q_residual, x, cos, sin, self.rotary)

        outputs, new_states = [], []
        for chunk, state in zip(chunks, states):
            rows = slice(chunk.start, chunk.start + chunk.length)
            window = torch.cat((state.window, kv[rows]))  # [w + L, D]
            extra_keys = selected = None
            compressor = indexer = None
            if self.compressor is not None:
                compressor = self.compressor.advance(state.compressor, raw[0][rows], raw[1][rows],
                                                     chunk.past, self.rotary, max_rollback)
                extra_keys = compressor.entries  # [n, D]
                n = extra_keys.shape[0]
                q_pos = torch.arange(chunk.past, chunk.past + chunk.length, device=x.device)
                entry = torch.arange(n, device=x.device)
                visible = (entry[None, :] + 1) * self.compressor.rate <= q_pos[:, None] + 1  # [L, n]
                selected = visible
                if self.indexer is not None:
                    indexer = self.indexer.compressor.advance(
                        state.indexer, raw_index[0][rows], raw_index[1][rows], chunk.past,
                        self.rotary, max_rollback)
                    selected = self.indexer.select(index_q[rows], index_w[rows], indexer.entries, visible)
            # Exactly the rows these queries can reach, however many spare rows the
            # state holds for rollback: the result must not depend on them, bit for bit.
            reach = min(chunk.past, self.sliding_window - 1) + chunk.length
            outputs.append(self._attend(q[rows], window[window.shape[0] - reach:], chunk,
                                        extra_keys, selected))
            keep = self.sliding_window - 1 + max_rollback
            window = window[max(0, window.shape[0] - keep):]
            new_states.append(LayerState(window=window, compressor=compressor, indexer=indexer))

        out = self.rotary.rotate(torch.cat(outputs), cos, -sin)  # [T, H, D], rotation undone
        grouped = out.reshape(x.shape[0], self.o_groups, -1)  # [T, G, H*D/G]
        w = self.o_a_proj.weight.view(self.o_groups, -1, grouped.shape[-1])  # [G, r, H*D/G]
        if self.batch_invariant:  # one row-invariant product a group
            low_rank = torch.cat([dense(grouped[:, g], w[g], True) for g in range(self.o_groups)],
                                 dim=-1)
        else:
            low_rank = torch.einsum("tgi,gri->tgr", grouped, w).flatten(1)  # [T, G*r]
        return self.o_b_proj(low_rank), new_states

    def _attend(self, q: torch.Tensor, window: torch.Tensor, chunk: ChunkView,
                extra_keys: torch.Tensor | None, selected: torch.Tensor | None) -> torch.Tensor:
        # q [L, H, D]; window [w + L, D] ending at the chunk's last token -> [L, H, D]
        if self.batch_invariant:
            return self._attend_invariant(q, window, chunk, extra_keys, selected)
        length = q.shape[0]
        q_pos = torch.arange(chunk.past, chunk.past + length, device=q.device)
        k_pos = torch.arange(chunk.past + length - window.shape[0], chunk.past + length, device=q.device)
        near = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - self.sliding_window)
        keys, allowed = window, near  # [S, D], [L, S]
        if extra_keys is not None:
            keys = torch.cat((window, extra_keys))
            allowed = torch.cat((near, selected), dim=1)
        scale = self.head_dim ** -0.5
        logits = torch.einsum("lhd,sd->hls", q.float(), keys.float()) * scale  # [H, L, S]
        logits = logits.masked_fill(~allowed, float("-inf"))
        sinks = self.sinks.float().view(-1, 1, 1).expand(-1, length, 1)
        probs = torch.cat((logits, sinks), dim=-1).softmax(dim=-1)[..., :-1]
        return torch.einsum("hls,sd->lhd", probs.to(keys.dtype), keys)

    def _attend_invariant(self, q: torch.Tensor, window: torch.Tensor, chunk: ChunkView,
                          extra_keys: torch.Tensor | None, selected: torch.Tensor | None
                          ) -> torch.Tensor:
        """:meth:`_attend` by :func:`attend_split`: window keys sit at their absolute
        position in splits of ``KV_SPLIT`` (zeros before and after), compressed entries
        at their index in splits of their own, every (token, head) a query row; so a
        query's keys meet the same reductions in any chunk, prompt or decode."""
        length, heads, d = q.shape
        first = chunk.past + length - window.shape[0]  # position of window[0]
        lead = first % KV_SPLIT
        span = -(-(lead + window.shape[0]) // KV_SPLIT) * KV_SPLIT
        n = 0 if extra_keys is None else extra_keys.shape[0]
        width = span + -(-n // KV_SPLIT) * KV_SPLIT
        keys = window.float().new_zeros(width, d)
        keys[lead:lead + window.shape[0]] = window.float()
        q_pos = torch.arange(chunk.past, chunk.past + length, device=q.device)[:, None]
        k_pos = torch.arange(first - lead, first - lead + span, device=q.device)[None, :]
        allowed = q.new_zeros(length, width, dtype=torch.bool)
        allowed[:, :span] = (k_pos <= q_pos) & (k_pos > q_pos - self.sliding_window)
        if n:
            keys[span:span + n] = extra_keys.float()
            allowed[:, span:span + n] = selected
        rows = -(-length * heads // ROW_TILE) * ROW_TILE
        qq = keys.new_zeros(1, rows, d)
        qq[0, :length * heads] = q.reshape(length * heads, d).float()
        masked = torch.ones(rows, width, dtype=torch.bool, device=q.device)
        masked[:length * heads] = ~allowed.repeat_interleave(heads, dim=0)
        sinks = self.sinks.float().repeat(length)
        sinks = torch.cat((sinks, sinks.new_zeros(rows - sinks.shape[0])))
        out = attend_split(qq, keys[None], keys[None], masked[None], self.head_dim ** -0.5,
                           sinks=sinks.view(1, rows, 1))
        return out[0, :length * heads].view(length, heads, d).to(window.dtype)
