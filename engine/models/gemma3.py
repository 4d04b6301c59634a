"""Gemma 3 (text): a Llama decoder whose layers norm before and after both the
attention and the MLP, every norm scaling by ``1 + w``.

The rest of what sets Gemma 3 apart is read by the Llama module from its
:class:`~formcast.engine.models.decoder_config.DecoderConfig`: embeddings times
``sqrt(hidden_size)``, q/k norms, GELU-tanh gate, five sliding layers to one
global one, the sliding layers with their own RoPE base, scores scaled by
``query_pre_attn_scalar ** -0.5``, soft-capped logits where configured, tied head.
Shapes: T tokens of the step, E hidden size.
"""

from __future__ import annotations

import torch
from torch import nn

from formcast.engine.config import LlamaConfig
from formcast.engine.layers.attention import AttentionMetadata
from formcast.engine.layers.norm import RMSNorm
from formcast.engine.layers.rotary import RotaryEmbedding
from formcast.engine.models.llama import (LlamaAttention, LlamaForCausalLM, LlamaMLP,
                                          decoder_config)


class Gemma3DecoderLayer(nn.Module):
    """``x + post_norm(attn(input_norm(x)))``, then ``x + post_ff_norm(mlp(pre_ff_norm(x)))``."""

    folded = False  # (nothing to fold: the norms after the projections stay)

    def __init__(self, config: LlamaConfig, layer: int = 0) -> None:
        super().__init__()
        spec = decoder_config(config)
        e, eps, offset = config.hidden_size, config.rms_norm_eps, spec.norm_offset
        self.input_layernorm = RMSNorm(e, eps, offset=offset)
        self.self_attn = LlamaAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(e, eps, offset=offset)
        self.pre_feedforward_layernorm = RMSNorm(e, eps, offset=offset)
        self.mlp = LlamaMLP(config)
        self.post_feedforward_layernorm = RMSNorm(e, eps, offset=offset)
        self.local_rope = spec.local_rope_theta is not None and spec.is_sliding(layer)

    def fold_norms(self) -> bool:
        return False

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, positions: torch.Tensor,
                rotary: RotaryEmbedding, kv_cache: torch.Tensor, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`LlamaDecoderLayer.forward`: ``pending`` is the last layer's
        normed MLP output, added to the stream in this layer's input norm."""
        if pending is None:
            h = self.input_layernorm.forward(x)
        else:
            x, h = self.input_layernorm.add_forward(x, pending)
        attn = self.self_attn.forward(h, positions, rotary, kv_cache, meta)
        x, h = self.pre_feedforward_layernorm.add_forward(
            x, self.post_attention_layernorm.forward(attn))
        return x, self.post_feedforward_layernorm.forward(self.mlp.forward(h))


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text decoder and its (tied) head; weights under transformers'
    ``Gemma3ForCausalLM`` names."""

    layer_class = Gemma3DecoderLayer
