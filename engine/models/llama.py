"""Llama-family decoder over the paged KV cache (SmolLM2 is one).

Projections are fused at load time (q|k|v and gate|up) so a layer runs two
matmuls fewer; weight names on the way in are transformers' LlamaForCausalLM names.
The other families' details (:class:`~formcast.engine.models.decoder_config.
DecoderConfig`: q/k/v biases, q/k norms, sliding windows, GELU gates, scaled
embeddings, soft-capped logits, a second RoPE for sliding layers) are read here
too; a plain :class:`LlamaConfig` has none of them.
Shapes: T tokens of the step (flattened over sequences), E hidden size.
"""

from __future__ import annotations

import torch
from torch import nn

from formcast.engine.config import LlamaConfig
from formcast.engine.kernels import triton_available
from formcast.engine.kernels.activation import gelu_tanh_and_mul, silu_and_mul
from formcast.engine.kernels.paged_attention import SPLIT_BELOW, rope_decode_attention
from formcast.engine.layers.attention import (AttentionMetadata, invariant_rope_attention,
                                              paged_attention)
from formcast.engine.layers.linear import Linear
from formcast.engine.layers.norm import RMSNorm
from formcast.engine.layers.rotary import RotaryEmbedding
from formcast.engine.models.decoder_config import DecoderConfig


def decoder_config(config: LlamaConfig) -> DecoderConfig:
    """``config`` as a :class:`DecoderConfig` (a plain Llama config: no family details)."""
    if isinstance(config, DecoderConfig):
        return config
    return DecoderConfig(**{f: getattr(config, f) for f in config.__dataclass_fields__})


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int = 0) -> None:
        super().__init__()
        spec = decoder_config(config)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = spec.attention_scale
        self.window = spec.window(layer)
        self.softcap = spec.attn_logit_softcapping
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=spec.has_qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.attention_bias)
        # per-head norms of queries and keys before the rotation (Qwen3, Gemma 3)
        self.q_norm = self.k_norm = None
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset=spec.norm_offset)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset=spec.norm_offset)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The fused projection's output [T, (H + 2 Hkv) * D], its query and key
        heads normed when the layer has q/k norms."""
        qkv = self.qkv_proj.forward(x)
        if self.q_norm is None:
            return qkv
        t, d = x.shape[0], self.head_dim
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm.forward(q.reshape(-1, d)).view(t, self.q_size)
        k = self.k_norm.forward(k.reshape(-1, d)).view(t, self.kv_size)
        return torch.cat([q, k, v], dim=-1)

    # a CUDA step of decode rows only (one a sequence: no draft positions) rotates
    # its new tokens, stores their keys and values and attends in one kernel
    # (rope_decode_attention), a launch a layer fewer; a verification step's draft
    # rows go the separate way (eagerly: graphs captured over the fused kernel do
    # not replay them). Half precision only: float32 speculation promises the
    # tokens of plain decoding, bit for bit, which one way for both keeps. Heads of
    # up to 64 and batches of one program a row and kv head (no split contexts):
    # it holds about the separate kernel's registers at head dim 64, and spills
    # at 128 (kilobytes with split contexts)
    fused_decode = True

    def decodes_fused(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step takes :func:`rope_decode_attention` (see above)."""
        t = x.shape[0]
        return x.is_cuda and self.fused_decode and x.dtype != torch.float32 and \
            not meta.batch_invariant and self.head_dim <= 64 and self.softcap is None and \
            t * self.num_kv_heads >= SPLIT_BELOW and \
            meta.one_token_rows and not meta.prefills and meta.num_decodes == t and \
            triton_available()

    def fused_decode_attention(self, x: torch.Tensor, positions: torch.Tensor,
                               rotary: RotaryEmbedding, kv_cache: torch.Tensor,
                               meta: AttentionMetadata, *, scale_by: torch.Tensor | None = None,
                               eps: float = 0.0) -> torch.Tensor:
        """The attention's output before ``o_proj`` [T, H * D] by the fused kernel
        (``scale_by``: the rows whose inverse RMS scales the projection, when the
        input norm's weight is folded into it)."""
        meta.rely_on_one_token_rows()
        o = rope_decode_attention(self.project(x), self.num_heads, self.num_kv_heads,
                                  positions, *rotary.tables(positions.device), kv_cache[0],
                                  kv_cache[1], meta.slot_mapping, meta.decode_block_tables,
                                  meta.decode_lens, self.scale, scale_by=scale_by, eps=eps,
                                  window=self.window)
        return o.reshape(x.shape[0], self.q_size)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        if self.decodes_fused(x, meta):
            return self.o_proj.forward(self.fused_decode_attention(x, positions, rotary,
                                                                   kv_cache, meta))
        qkv = self.project(x)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        # q and k rotate together (one set of ops for both): [T, H + Hkv, D]; on CUDA
        # the keys and values go to the cache in the same kernel
        qk, stored = rotary.rotate_and_store(
            positions, qk.view(t, self.num_heads + self.num_kv_heads, self.head_dim), v,
            kv_cache[0], kv_cache[1], meta.slot_mapping)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, H, D], [T, Hkv, D]
        o = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, stored=stored,
                            window=self.window, softcap=self.softcap)
        return self.o_proj.forward(o.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size,
                                      bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size,
                                   bias=config.mlp_bias)
        self.gelu = decoder_config(config).hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        return self.down_proj.forward(gelu_tanh_and_mul(gate_up) if self.gelu
                                      else silu_and_mul(gate_up))


class LlamaDecoderLayer(nn.Module):
    # the norms' weights folded into the projections after them (see
    # LlamaForCausalLM.fold_norms): the fused decode step then runs no norm kernel
    folded = False

    def __init__(self, config: LlamaConfig, layer: int = 0) -> None:
        super().__init__()
        spec = decoder_config(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        # the sliding layers' own RoPE (LlamaModel.local_rotary), where the model has one
        self.local_rope = spec.local_rope_theta is not None and spec.is_sliding(layer)

    def fold_norms(self) -> bool:
        """Fold each norm's weight into the projection that reads its output
        (``W[:, j] *= w[j]``, in float32, rounded once), the norms left with
        weights of ones: the same layer, up to rounding. New tensors throughout
        (the weights' first tensors, which a caller may hold, stay as they
        are). False (nothing changed) where a projection has a bias or is not a
        plain :class:`Linear` (a bias would be scaled along with the product), or
        where the layer norms its query and key heads or gates with GELU (the
        folded step has neither)."""
        attn, mlp = self.self_attn, self.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if self.folded or any(type(m) is not Linear or m.bias is not None for m in linears) \
                or attn.q_norm is not None or mlp.gelu:
            return self.folded
        with torch.no_grad():
            for norm, proj in ((self.input_layernorm, attn.qkv_proj),
                               (self.post_attention_layernorm, mlp.gate_up_proj)):
                w = proj.weight
                proj.weight = nn.Parameter((w.float() * norm.weight.float()).to(w.dtype),
                                           requires_grad=False)
                norm.weight = nn.Parameter(torch.ones_like(norm.weight), requires_grad=False)
        self.folded = True
        return True

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, positions: torch.Tensor,
                rotary: RotaryEmbedding, kv_cache: torch.Tensor, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: the residual stream, ``pending``: the last layer's MLP output not
        yet added to it (None before the first layer); the add is fused into this
        layer's input norm. Returns the stream and this layer's MLP output."""
        # .forward directly: a decode step makes ~10 module calls per layer, and
        # nn.Module.__call__'s hook machinery costs more than some of the ops.
        # (Folding the residual add and norm into the projection after it, and the
        # gate into the gate|up projection, one Triton GEMM each, measured slower
        # than the norm kernel + cuBLAS + the gate kernel: cuBLAS and separate
        # norms it is. What a folded layer's fused decode step does is another
        # thing: the norm's weight goes into
        # cuBLAS's projection, its row scale into the Triton kernel after it; see
        # _folded_decode.)
        if self.folded and self.self_attn.decodes_fused(x, meta):
            return self._folded_decode(x, pending, positions, rotary, kv_cache, meta)
        if self.folded and meta.batch_invariant and x.is_cuda:
            return self.invariant_step(x, pending, positions, rotary, kv_cache, meta)
        if pending is None:
            h = self.input_layernorm.forward(x)
        else:
            x, h = self.input_layernorm.add_forward(x, pending)
        attn = self.self_attn.forward(h, positions, rotary, kv_cache, meta)
        x, h = self.post_attention_layernorm.add_forward(x, attn)  # x + attn, its norm
        return x, self.mlp.forward(h)

    def _folded_decode(self, x: torch.Tensor, pending: torch.Tensor | None,
                       positions: torch.Tensor, rotary: RotaryEmbedding,
                       kv_cache: torch.Tensor, meta: AttentionMetadata
                       ) -> tuple[torch.Tensor, None]:
        """A fused decode step of a folded layer in six kernels rather than eight:
        the projections after the norms read the residual stream itself, and
        the kernels after them (attention, gate) scale each row by its inverse
        RMS, which they find from the stream's row; the residual adds ride on
        the output projections (cuBLAS's accumulate into the stream, in place).
        Returns the stream with this layer's MLP output added (nothing pending)."""
        attn, mlp = self.self_attn, self.mlp
        if pending is not None:
            x = x + pending
        elif x._base is not None or not x.is_contiguous():  # (written in place below)
            x = x.clone(memory_format=torch.contiguous_format)
        o = attn.fused_decode_attention(x, positions, rotary, kv_cache, meta, scale_by=x,
                                        eps=self.input_layernorm.eps)
        x.addmm_(o, attn.o_proj.weight.t())
        act = silu_and_mul(mlp.gate_up_proj.forward(x), scale_by=x,
                           eps=self.post_attention_layernorm.eps)
        x.addmm_(act, mlp.down_proj.weight.t())
        return x, None

    def invariant_step(self, x: torch.Tensor, pending: torch.Tensor | None,
                       positions: torch.Tensor, rotary: RotaryEmbedding,
                       kv_cache: torch.Tensor, meta: AttentionMetadata
                       ) -> tuple[torch.Tensor, None]:
        """The layer in batch-invariant mode on CUDA (:meth:`forward` takes it for a
        folded layer, see :meth:`fold_norms`), for every step, prompt and decode
        rows alike: the fixed-plan GEMMs of
        :mod:`formcast.engine.kernels.invariant_matmul_triton` carry the norms'
        row scales, the gate and the residual adds, and the attention is
        :func:`~formcast.engine.layers.attention.invariant_rope_attention` where
        the heads allow it; a decode step is then five kernels a layer, and no
        row's bits depend on another's. Arguments as :meth:`forward`; runs
        wherever Triton does (its interpreter too). Returns the stream (nothing
        pending)."""
        from formcast.engine.kernels.invariant_matmul_triton import invariant_linear_triton

        attn, mlp = self.self_attn, self.mlp
        if pending is not None:
            x = x + pending
        t = x.shape[0]
        qkv = invariant_linear_triton(x, attn.qkv_proj.weight, scale_eps=self.input_layernorm.eps)
        if attn.fused_decode and attn.head_dim <= 64 and attn.softcap is None:
            o = invariant_rope_attention(qkv, attn.num_heads, attn.num_kv_heads, positions,
                                         rotary, kv_cache[0], kv_cache[1], meta, attn.scale,
                                         attn.window)
        else:
            qk, v = qkv.split([attn.q_size + attn.kv_size, attn.kv_size], dim=-1)
            v = v.view(t, attn.num_kv_heads, attn.head_dim)
            qk, stored = rotary.rotate_and_store(
                positions, qk.view(t, attn.num_heads + attn.num_kv_heads, attn.head_dim), v,
                kv_cache[0], kv_cache[1], meta.slot_mapping)
            q, k = qk.split([attn.num_heads, attn.num_kv_heads], dim=1)
            o = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, attn.scale,
                                stored=stored, window=attn.window, softcap=attn.softcap)
        x = invariant_linear_triton(o.reshape(t, attn.q_size), attn.o_proj.weight, residual=x)
        act = invariant_linear_triton(x, mlp.gate_up_proj.weight, gated=True,
                                      scale_eps=self.post_attention_layernorm.eps)
        return invariant_linear_triton(act, mlp.down_proj.weight, residual=x), None


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig, layer_class: type[nn.Module] = LlamaDecoderLayer
                 ) -> None:
        super().__init__()
        spec = decoder_config(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer_class(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=spec.norm_offset)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, config.rope_scaling)
        self.local_rotary = None if spec.local_rope_theta is None else RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, spec.local_rope_theta)
        self.embedding_scale = spec.embedding_scale
        self._scale: torch.Tensor | None = None

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, E], times the embedding scale where the family has
        one (rounded to the weights' dtype first, as transformers' Gemma does)."""
        x = self.embed_tokens(token_ids)
        if self.embedding_scale is None:
            return x
        if self._scale is None or self._scale.dtype != x.dtype or self._scale.device != x.device:
            self._scale = torch.full((), self.embedding_scale, dtype=x.dtype, device=x.device)
        return x * self._scale

    def rotary_of(self, layer: nn.Module) -> RotaryEmbedding:
        return self.local_rotary if layer.local_rope else self.rotary


class LlamaForCausalLM(nn.Module):
    """The decoder plus its head. ``forward`` returns hidden states; ``logits`` the head."""

    layer_class: type[nn.Module] = LlamaDecoderLayer

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.layer_class)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.final_softcap = decoder_config(config).final_logit_softcapping
        self.tie_weights()

    def fold_norms(self) -> bool:
        """Fold every decoder layer's norm weights into its projections
        (:meth:`LlamaDecoderLayer.fold_norms`): a CUDA decode step in
        bfloat16 then runs two kernels a layer fewer. The final norm stays
        (the head may be the embedding's). True when every layer folded."""
        return all([layer.fold_norms() for layer in self.model.layers])

    def tie_weights(self) -> None:
        """Share the embedding with the head when the config says so (again after
        ``to_empty``, which allocates every parameter separately)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor],
                meta: AttentionMetadata | list[AttentionMetadata]) -> torch.Tensor:
        # token_ids, positions [T]; kv_caches[layer] [2, NBtotal, BS, Hkv, D] -> [T, E];
        # meta: every layer's, or one a layer (KV groups: each group its block tables)
        model = self.model
        x = model.embed(token_ids)
        pending = None
        metas = meta if isinstance(meta, list) else [meta] * len(kv_caches)
        for layer, kv_cache, m in zip(model.layers, kv_caches, metas):
            x, pending = layer.forward(x, pending, positions, model.rotary_of(layer), kv_cache, m)
        return x if pending is None else x + pending

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [N, E] -> [N, V] in float32
        hidden = self.model.norm(hidden)
        head = self.lm_head
        if isinstance(head, Linear):  # (a quantized head is another module)
            logits = head.forward_float32(hidden)
        else:
            logits = head(hidden).float()
        if self.final_softcap is not None:
            cap = self.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy transformers-named weights in, fusing q|k|v and gate|up.

        Raises ``ValueError`` naming missing, unexpected or misshaped tensors, and
        on a model whose norms were folded (:meth:`fold_norms`: its projections
        are no longer the file's).
        """
        if any(layer.folded for layer in self.model.layers):
            raise ValueError("this model's norm weights are folded into its projections "
                             "(fold_norms): load weights into a model built afresh")
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        params = dict(self.named_parameters())
        parts: dict[str, dict[int, torch.Tensor]] = {}
        seen: set[str] = set()
        for name, tensor in weights.items():
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            module, _, leaf = name.rpartition(".")
            prefix, _, proj = module.rpartition(".")
            if proj in fused:
                target, index = fused[proj]
                parts.setdefault(f"{prefix}.{target}.{leaf}", {})[index] = tensor
                continue
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} for a Llama model")
            _copy(params[name], tensor, name)
            seen.add(name)
        for name, pieces in parts.items():
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} for a Llama model")
            want = 3 if ".qkv_proj." in name else 2
            if sorted(pieces) != list(range(want)):
                raise ValueError(f"incomplete fused weight {name!r}: got parts {sorted(pieces)}")
            _copy(params[name], torch.cat([pieces[i] for i in range(want)], dim=0), name)
            seen.add(name)
        missing = sorted(set(params) - seen)
        if missing:
            raise ValueError(f"missing weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(param.shape)}")
    param.copy_(tensor)
