"""DeepSeek-V4 decoder over per-sequence states, with its MTP (next-token) layer.

A step is a batch of per-sequence chunks: ``lengths[i]`` consecutive tokens of
sequence ``i`` (several for prefill, chunked prefill or verification, one for decode),
flattened in order. Each sequence's :class:`DeepseekV4State` is owned by the caller and
advanced in place by ``forward``; ``snapshot``/``restore`` or ``truncate_state`` roll it
back (transformers' cache cannot).

The residual stream is ``hc_mult`` parallel streams (manifold-constrained
hyper-connections): before each attention/MoE block a learned mix collapses them to
one input, after it the block output is spread back onto the streams and added to a
doubly stochastic (Sinkhorn-projected) mix of the old streams. ``forward`` returns the
streams; ``logits`` collapses them (``hc_head``), norms and projects.

Weight names are transformers' ``DeepseekV4ForCausalLM`` state-dict names, plus
``mtp.0.*`` for the MTP layer (see :mod:`formcast.engine.loader.deepseek_v4`).

Legend: ``T`` tokens of the step, ``N`` hc streams, ``E`` hidden size, ``V`` vocab.
"""

from __future__ import annotations

import torch
from torch import nn

from formcast.engine.config import DeepseekV4Config
from formcast.engine.kernels.invariant_pointwise import pointwise
from formcast.engine.layers.linear import Linear
from formcast.engine.models.deepseek_v4_attention import ChunkView, DeepseekV4Attention
from formcast.engine.models.deepseek_v4_common import V4RMSNorm, V4Rotary, dense, rms_normalize
from formcast.engine.models.deepseek_v4_moe import DeepseekV4MoE
from formcast.engine.models.deepseek_v4_state import DeepseekV4State, LayerState


class HyperConnection(nn.Module):
    """Mixing weights of one mHC site, computed per token from the streams.

    From the RMS-normed flattened streams a linear map gives ``pre`` (collapse
    weights, ``sigmoid + eps``), ``post`` (spread weights, ``2 sigmoid``) and ``comb``
    (``N x N`` stream mix: row softmax + eps, then Sinkhorn row/column normalization).
    """

    batch_invariant: bool = False  # (row-invariant mixing map and stream sums; set by the runner)

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        n = config.hc_mult
        self.n, self.iters, self.hc_eps, self.eps = n, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * config.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams ``[T, N, E]`` -> post ``[T, N]``, comb ``[T, N, N]`` (float32) and the
        collapsed block input ``[T, E]`` in the streams' dtype."""
        n = self.n
        mixes = dense(rms_normalize(streams.flatten(1).float(), self.eps), self.fn.float(),
                      self.batch_invariant)
        pre, post, comb = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        inv = self.batch_invariant
        pre = pointwise(torch.sigmoid, pre * self.scale[0] + pre_b, inv) + self.hc_eps
        post = 2 * pointwise(torch.sigmoid, post * self.scale[1] + post_b, inv)
        comb = (comb * self.scale[2] + comb_b).unflatten(-1, (n, n)).softmax(dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = _stream_sum(pre, streams, self.batch_invariant).to(streams.dtype)
        return post, comb, collapsed


class HyperHead(nn.Module):
    """Final collapse of the streams: ``sum_j (sigmoid(mix_j) + eps) * stream_j``."""

    batch_invariant: bool = False

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        n = config.hc_mult
        self.hc_eps, self.eps = config.hc_eps, config.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(n, n * config.hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """streams ``[T, N, E]`` -> ``[T, E]``."""
        mixes = dense(rms_normalize(streams.flatten(1).float(), self.eps), self.hc_fn.float(),
                      self.batch_invariant)
        pre = pointwise(torch.sigmoid, mixes * self.hc_scale.float() + self.hc_base.float(),
                        self.batch_invariant) + self.hc_eps
        return _stream_sum(pre, streams, self.batch_invariant).to(streams.dtype)


def _stream_sum(weights: torch.Tensor, streams: torch.Tensor, invariant: bool) -> torch.Tensor:
    # sum_j weights[:, j] * stream_j: weights [T, N], streams [T, N, E] -> [T, E]; with
    # ``invariant`` added stream after stream, whatever T
    if not invariant:
        return (weights[..., None] * streams).sum(dim=1)
    out = weights[:, 0, None] * streams[:, 0]
    for j in range(1, streams.shape[1]):
        out = out + weights[:, j, None] * streams[:, j]
    return out


def _mix(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor,
         invariant: bool = False) -> torch.Tensor:
    # new stream k = post_k * out + sum_j comb[j, k] * stream_j  -> [T, N, E]
    dtype = streams.dtype
    spread = post.to(dtype)[..., None] * out[:, None, :]
    comb = comb.to(dtype)
    if not invariant:
        return spread + comb.transpose(-1, -2) @ streams
    return spread + torch.stack([_stream_sum(comb[:, :, k], streams, True)
                                 for k in range(streams.shape[1])], dim=1)


class DeepseekV4DecoderLayer(nn.Module):
    """Attention and MoE blocks, each between two mHC sites."""

    batch_invariant: bool = False  # (the stream mixes in a fixed order; set by the runner)

    def __init__(self, config: DeepseekV4Config, layer_type: str, *, hashed: bool,
                 rotary: V4Rotary) -> None:
        super().__init__()
        self.self_attn = DeepseekV4Attention(config, layer_type, rotary)
        self.mlp = DeepseekV4MoE(config, hashed=hashed)
        self.input_layernorm = V4RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = V4RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(self, streams: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor,
                chunks: list[ChunkView], states: list[LayerState], max_rollback: int
                ) -> tuple[torch.Tensor, list[LayerState]]:
        """streams ``[T, N, E]`` -> new streams and each chunk's new layer state."""
        post, comb, x = self.attn_hc(streams)
        out, states = self.self_attn(self.input_layernorm(x), positions, chunks, states, max_rollback)
        streams = _mix(post, comb, out, streams, self.batch_invariant)
        post, comb, x = self.ffn_hc(streams)
        out = self.mlp(self.post_attention_layernorm(x), token_ids)
        return _mix(post, comb, out, streams, self.batch_invariant), states


class DeepseekV4MTPLayer(DeepseekV4DecoderLayer):
    """The next-n (MTP) layer: drafts token ``i + 2`` from the main model's streams at
    position ``i`` and the embedding of token ``i + 1``.

    Math (DeepSeek's released V4 inference code; transformers does not implement it):
    ``x_j = e_proj(enorm(embed(t_{i+1}))) + h_proj(hnorm(stream_j))`` for each stream
    ``j``, one decoder layer (sliding-window attention over the MTP layer's own window
    state, score-routed MoE), then its own ``hc_head`` and ``norm``, then the main
    model's ``lm_head``.
    """

    def __init__(self, config: DeepseekV4Config, rotary: V4Rotary) -> None:
        super().__init__(config, "sliding_attention", hashed=False, rotary=rotary)
        e = config.hidden_size
        self.enorm = V4RMSNorm(e, config.rms_norm_eps)
        self.hnorm = V4RMSNorm(e, config.rms_norm_eps)
        self.e_proj = Linear(e, e, bias=False)
        self.h_proj = Linear(e, e, bias=False)
        self.hc_head = HyperHead(config)
        self.norm = V4RMSNorm(e, config.rms_norm_eps)


class DeepseekV4Model(nn.Module):
    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        self.rotary_main = V4Rotary(config.rope_main, config.qk_rope_head_dim)
        self.rotary_compress = V4Rotary(config.rope_compress, config.qk_rope_head_dim)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekV4DecoderLayer(
                config, kind, hashed=config.mlp_layer_types[i] == "hash_moe",
                rotary=self.rotary_main if kind == "sliding_attention" else self.rotary_compress)
            for i, kind in enumerate(config.layer_types))
        self.norm = V4RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hc_head = HyperHead(config)


class DeepseekV4ForCausalLM(nn.Module):
    """DeepSeek-V4 with its head and (optionally) its MTP layer.

    Parameters
    ----------
    config : DeepseekV4Config
    with_mtp : bool
        Build the MTP layer (``mtp.0.*`` weights); HF-layout checkpoints written by
        transformers have none.
    """

    def __init__(self, config: DeepseekV4Config, *, with_mtp: bool = False) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekV4Model(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mtp = nn.ModuleList([DeepseekV4MTPLayer(config, self.model.rotary_main)] if with_mtp else [])
        self.lockstep = None  # expert parallel: formcast.engine.parallel.worker.Lockstep
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def set_batch_invariant(self, on: bool) -> None:
        """Batch-invariant mode for every part of the model: a row's results then do
        not depend on the rows or chunks it shares a step with (the runner sets it)."""
        for module in self.modules():
            if hasattr(type(module), "batch_invariant"):
                module.batch_invariant = on

    # -- state -----------------------------------------------------------------------

    def new_state(self, *, max_rollback: int = 16) -> DeepseekV4State:
        """An empty state for one new sequence, on the model's device and dtype.

        ``max_rollback`` bounds how many tokens :meth:`truncate_state` may remove at
        once (it sizes how many past rows the state keeps).
        """
        weight = self.model.embed_tokens.weight
        return DeepseekV4State(
            [layer.self_attn.empty_state(weight.device, weight.dtype) for layer in self.model.layers],
            [layer.self_attn.empty_state(weight.device, weight.dtype) for layer in self.mtp],
            max_rollback=max_rollback)

    def truncate_state(self, state: DeepseekV4State, num_tokens: int) -> None:
        """Roll ``state`` back to its first ``num_tokens`` tokens (changes ``state``);
        see :meth:`DeepseekV4State.truncate` for the limits."""
        state.truncate(num_tokens, rates=[self.config.compress_rate(i)
                                          for i in range(self.config.num_hidden_layers)])

    # -- compute -----------------------------------------------------------------------

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor,
                states: list[DeepseekV4State], lengths: list[int]) -> torch.Tensor:
        """Run one step of per-sequence chunks through the main layers.

        Parameters
        ----------
        token_ids, positions : torch.Tensor
            ``[T]``; chunk ``i`` is ``lengths[i]`` consecutive tokens of sequence ``i``
            at positions ``states[i].num_tokens ..`` (the caller keeps them in step).
        states : list[DeepseekV4State]
            One per chunk, distinct sequences; each is advanced by its chunk.
        lengths : list[int]
            Tokens per chunk, each >= 1, summing to ``T``.

        Returns
        -------
        torch.Tensor
            The residual streams ``[T, N, E]``; :meth:`logits` turns rows into logits,
            :meth:`mtp_logits` drafts from them.

        Raises
        ------
        ValueError
            Lengths that do not match the tokens or the states.
        """
        if self.lockstep is not None:  # expert parallel: every rank runs this forward
            self.lockstep.enter_forward()
        chunks = _chunks(token_ids, states, lengths, [s.num_tokens for s in states])
        x = self.model.embed_tokens(token_ids)
        streams = x[:, None, :].expand(-1, self.config.hc_mult, -1).contiguous()
        for i, layer in enumerate(self.model.layers):
            streams, new = layer(streams, positions, token_ids, chunks, [s.layers[i] for s in states],
                                 _rollback(states))
            for state, layer_state in zip(states, new):
                state.layers[i] = layer_state
        for state, length in zip(states, lengths):
            state.num_tokens += length
        return streams

    def idle_forward(self) -> None:
        """A forward without tokens, for a rank with nothing to run while the others
        run one: it joins every MoE layer's expert exchange with an empty batch."""
        e, k = self.config.hidden_size, self.config.num_experts_per_tok
        dtype, dev = self.model.embed_tokens.weight.dtype, self.model.embed_tokens.weight.device
        for layer in self.model.layers:
            layer.mlp.experts(torch.empty(0, e, dtype=dtype, device=dev),
                              torch.empty(0, k, dtype=torch.long, device=dev),
                              torch.empty(0, k, dtype=torch.float32, device=dev))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Streams ``[M, N, E]`` (rows of :meth:`forward`'s output) -> float32 ``[M, V]``."""
        return self.lm_head(self.model.norm(self.model.hc_head(hidden))).float()

    def mtp_logits(self, hidden: torch.Tensor, next_token_ids: torch.Tensor, positions: torch.Tensor,
                   states: list[DeepseekV4State], lengths: list[int]) -> torch.Tensor:
        """Draft logits of the MTP layer (advances each state's MTP part).

        Parameters
        ----------
        hidden : torch.Tensor
            ``[T, N, E]`` main-model streams at positions ``positions`` (rows of
            :meth:`forward`'s output).
        next_token_ids : torch.Tensor
            ``[T]``: for the row at position ``p``, the token at ``p + 1``.
        positions : torch.Tensor
            ``[T]``; chunk ``i`` starts at ``states[i].mtp_num_tokens``.
        states, lengths
            As for :meth:`forward`.

        Returns
        -------
        torch.Tensor
            float32 ``[T, V]``: logits for the token at ``p + 2``.

        Raises
        ------
        ValueError
            The model has no MTP layer, or lengths do not match.
        """
        if not len(self.mtp):
            raise ValueError("this model was built without its MTP layer (with_mtp=False, or the "
                             "checkpoint has no mtp.* weights)")
        mtp = self.mtp[0]
        chunks = _chunks(next_token_ids, states, lengths, [s.mtp_num_tokens for s in states])
        e = mtp.e_proj(mtp.enorm(self.model.embed_tokens(next_token_ids)))  # [T, E]
        streams = e[:, None, :] + mtp.h_proj(mtp.hnorm(hidden).flatten(0, 1)).view_as(hidden)
        streams, new = mtp(streams, positions, next_token_ids, chunks,
                           [s.mtp_layers[0] for s in states], _rollback(states))
        for state, layer_state, length in zip(states, new, lengths):
            state.mtp_layers[0] = layer_state
            state.mtp_num_tokens += length
        return self.lm_head(mtp.norm(mtp.hc_head(streams))).float()

    # -- weights -----------------------------------------------------------------------

    def cast_(self, dtype: torch.dtype) -> "DeepseekV4ForCausalLM":
        """Cast weights to ``dtype`` in place, keeping in float32 what DeepSeek keeps
        there (norm weights, hyper-connection maps, sinks, compressor position
        biases, the router's correction bias); returns self."""
        keep_modules = (V4RMSNorm, HyperConnection, HyperHead)
        for module in self.modules():
            if isinstance(module, keep_modules):
                continue
            for name, param in module.named_parameters(recurse=False):
                if name not in ("sinks", "position_bias"):
                    param.data = param.data.to(dtype)
        return self

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy weights in, by transformers' names (``mtp.0.*`` for the MTP layer).

        Raises ``ValueError`` naming missing, unexpected or misshaped tensors.
        """
        targets = dict(self.named_parameters())
        targets.update(self.named_buffers())
        if self.config.tie_word_embeddings:
            targets.pop("lm_head.weight", None)
        seen = set()
        for name, tensor in weights.items():
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target = _module_name(name)
            if target not in targets:
                raise ValueError(f"unexpected weight {name!r} for this DeepSeek-V4 model")
            dest = targets[target]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            seen.add(target)
        missing = sorted(set(targets) - seen)
        if missing:
            raise ValueError(f"missing weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")


_INDEXER_RENAMES = (  # transformers nests the indexer in the compressor; we keep it beside
    (".compressor.indexer.scorer.weights_proj.", ".indexer.weights_proj."),
    (".compressor.indexer.q_b_proj.", ".indexer.q_b_proj."),
    (".compressor.indexer.", ".indexer.compressor."),
)


def _module_name(name: str) -> str:
    for old, new in _INDEXER_RENAMES:
        if old in name:
            return name.replace(old, new)
    return name


def transformers_name(name: str) -> str:
    """The transformers name of our parameter or buffer ``name`` (the inverse of the
    renames :meth:`DeepseekV4ForCausalLM.load_weights` applies)."""
    for old, new in _INDEXER_RENAMES:
        if new in name:
            return name.replace(new, old)
    return name


def _rollback(states: list[DeepseekV4State]) -> int:
    return states[0].max_rollback if states else 0


def _chunks(token_ids: torch.Tensor, states: list[DeepseekV4State], lengths: list[int],
            past: list[int]) -> list[ChunkView]:
    if len(states) != len(lengths):
        raise ValueError(f"got {len(states)} states for {len(lengths)} chunk lengths")
    if any(n < 1 for n in lengths) or sum(lengths) != token_ids.shape[0]:
        raise ValueError(f"chunk lengths {lengths} must be >= 1 and sum to the {token_ids.shape[0]} tokens")
    if len({id(s) for s in states}) != len(states):
        raise ValueError("one state appears twice in a step; give each sequence one chunk")
    if len({s.max_rollback for s in states}) > 1:
        raise ValueError("states of one step must share max_rollback")
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return [ChunkView(start=a, length=n, past=p) for a, n, p in zip(starts, lengths, past)]
