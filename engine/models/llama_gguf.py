"""A Llama decoder whose layers run one native call a step on the CPU.

What :func:`formcast.engine.loading.build_gguf_model` builds: every projection a
:class:`~formcast.engine.layers.quant.GGUFLinear` on the file's own blocks, and each
layer's whole step (norms, quantized projections, RoPE, the KV write, attention over
the paged cache, SwiGLU, the residual adds) one call of
:func:`formcast.engine.kernels.native.decoder_layer`, with no Python or torch op
in between. Every row, prompt or generated, is computed alone by the same code: a
row's result does not depend on its batch, nor on whether its keys came from a
prefix cache. Without the extension (``FORMCAST_NATIVE=0``) the layer runs the
torch path of :class:`~formcast.engine.models.llama.LlamaDecoderLayer`.

Shapes: T tokens of the step, E hidden size, NB blocks a row.
"""

from __future__ import annotations

import torch

from formcast.engine.kernels import native
from formcast.engine.layers.attention import AttentionMetadata
from formcast.engine.layers.quant import GGUFLinear
from formcast.engine.layers.rotary import RotaryEmbedding
from formcast.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class GGUFDecoderLayer(LlamaDecoderLayer):
    """A Llama layer whose step is one native call (module doc), where it can be."""

    _native: tuple[list[torch.Tensor], list[int], list[int]] | None = None
    # the projections (bits: q|k|v, o, gate|up, down) whose inputs go in with more
    # than 8 bits (16-bit codes, or int8 codes plus those of their rounding error:
    # native.decoder_layer's two_level): closer to float32's greedy tokens
    two_level_activations = 0b1111

    def native_weights(self) -> tuple[list[torch.Tensor], list[int], list[int]] | None:
        """The four projections' parts, type ids and part counts for the native call;
        None where the layer has what the call does not do (biases, q/k norms, GELU,
        a soft cap, projections that are not GGUF blocks)."""
        if self._native is None:
            attn, mlp = self.self_attn, self.mlp
            projs = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if any(not isinstance(p, GGUFLinear) or p.bias is not None for p in projs) or \
                    attn.q_norm is not None or attn.softcap is not None or mlp.gelu or \
                    self.input_layernorm.offset or self.post_attention_layernorm.offset:
                self._native = ([], [], [])
            else:
                parts = [part for p in projs for part in p.parts]
                self._native = ([b for b, _ in parts], [native.BLOCK_TYPES[q][0] for _, q in parts],
                                [len(p.parts) for p in projs])
        return self._native if self._native[0] else None

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, positions: torch.Tensor,
                rotary: RotaryEmbedding, kv_cache: torch.Tensor, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        weights = self.native_weights()
        if weights is None or x.dtype != torch.float32 or x.device.type != "cpu" or \
                kv_cache.dtype != torch.float32 or not native.available():
            return super().forward(x, pending, positions, rotary, kv_cache, meta)
        attn = self.self_attn
        if pending is None and (x._base is not None or not x.is_contiguous()):
            x = x.contiguous().clone()  # (written in place)
        tables, limits = row_keys(meta, x.shape[0])
        cos, sin = rotary.tables(x.device)
        native.decoder_layer(x, pending, (self.input_layernorm.weight,
                                          self.post_attention_layernorm.weight),
                             self.input_layernorm.eps, *weights, positions, cos, sin, kv_cache,
                             meta.slot_mapping, tables, limits, heads=attn.num_heads,
                             kv_heads=attn.num_kv_heads, scale=attn.scale, window=attn.window,
                             two_level=self.two_level_activations)
        return x, None


def row_keys(meta: AttentionMetadata, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's block table [T, NB] and the keys it sees [T] (its position + 1), for
    decode rows and prompt rows alike; made once a step (kept on ``meta``)."""
    cached = meta.__dict__.get("_native_row_keys")
    if cached is not None:
        return cached
    if meta.num_decodes == t and not meta.prefills:  # (rows 0..T-1 in order)
        cached = (meta.decode_block_tables.contiguous(), meta.decode_lens.contiguous())
    else:
        width = max([meta.decode_block_tables.shape[1]] +
                    [p.block_table.shape[0] for p in meta.prefills])
        tables = torch.zeros(t, width, dtype=torch.long)
        limits = torch.ones(t, dtype=torch.long)
        if meta.num_decodes:
            tables[meta.decode_rows, :meta.decode_block_tables.shape[1]] = meta.decode_block_tables
            limits[meta.decode_rows] = meta.decode_lens
        for p in meta.prefills:
            tables[p.start:p.start + p.length, :p.block_table.shape[0]] = p.block_table
            limits[p.start:p.start + p.length] = torch.arange(p.context_len - p.length + 1,
                                                              p.context_len + 1)
        cached = (tables, limits)
    object.__setattr__(meta, "_native_row_keys", cached)
    return cached


class GGUFLlamaForCausalLM(LlamaForCausalLM):
    """:class:`LlamaForCausalLM` with :class:`GGUFDecoderLayer` layers, all of them run
    by one native call a step where every layer can be (one RoPE, one attention
    metadata, the same settings)."""

    layer_class = GGUFDecoderLayer
    _plan: tuple | None = None

    def native_plan(self) -> tuple | None:
        """(norms, weights, type ids, counts, eps, two-level mask) of every layer for
        :func:`native.decoder_layers`; None where a layer cannot run natively or the
        layers differ (windows, RoPE, settings). Made again when a layer's
        ``two_level_activations`` changes."""
        layers = list(self.model.layers)
        masks = {layer.two_level_activations for layer in layers}
        if self._plan is not None and self._plan[0] == masks:
            return self._plan[1]
        plan = None
        got = [layer.native_weights() for layer in layers]
        first = layers[0].self_attn
        if all(g is not None for g in got) and len(masks) == 1 and \
                self.model.local_rotary is None and \
                all(layer.self_attn.window == first.window for layer in layers) and \
                len({layer.input_layernorm.eps for layer in layers} |
                    {layer.post_attention_layernorm.eps for layer in layers}) == 1:
            norms = [n for layer in layers
                     for n in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)]
            plan = (norms, [w for g in got for w in g[0]], [q for g in got for q in g[1]],
                    [c for g in got for c in g[2]], layers[0].input_layernorm.eps, masks.pop())
        self._plan = ({layer.two_level_activations for layer in layers}, plan)
        return plan

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor],
                meta: AttentionMetadata | list[AttentionMetadata]) -> torch.Tensor:
        # token_ids, positions [T] -> hidden states [T, E]
        plan = self.native_plan() if isinstance(meta, AttentionMetadata) else None
        if plan is None or token_ids.device.type != "cpu" or not native.available() or \
                any(c.dtype != torch.float32 for c in kv_caches):
            return super().forward(token_ids, positions, kv_caches, meta)
        norms, weights, qtypes, counts, eps, two_level = plan
        x = self.model.embed(token_ids)
        if x._base is not None or not x.is_contiguous():
            x = x.contiguous().clone()  # (written in place)
        tables, limits = row_keys(meta, x.shape[0])
        cos, sin = self.model.rotary.tables(x.device)
        attn = self.model.layers[0].self_attn
        return native.decoder_layers(x, norms, eps, weights, qtypes, counts, positions, cos, sin,
                                     kv_caches, meta.slot_mapping, tables, limits,
                                     heads=attn.num_heads, kv_heads=attn.num_kv_heads,
                                     scale=attn.scale, window=attn.window, two_level=two_level)
