"""Known model shapes, and random weights for them.

Random weights of a real shape let GPU paths be tested and benchmarked without
moving a checkpoint: the compute per token is the real model's.
"""

from __future__ import annotations

import torch

from formcast.engine.config import LlamaConfig

SHAPES: dict[str, LlamaConfig] = {
    "smollm2-135m": LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True),
    "llama-1b": LlamaConfig(
        vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=True),
}


def random_llama_weights(config: LlamaConfig, *, seed: int = 0, std: float = 0.02,
                         head_std: float | None = None) -> dict[str, torch.Tensor]:
    """Float32 weights under transformers' names, drawn from N(0, std) (norms are 1).

    ``head_std`` (default: ``std``) scales the embedding/head; a larger value gives
    peaked next-token distributions, so greedy decoding is not decided by near-ties.
    """
    gen = torch.Generator().manual_seed(seed)
    e, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim

    def normal(*shape: int, scale: float = std) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    weights = {"model.embed_tokens.weight": normal(config.vocab_size, e, scale=head_std or std),
               "model.norm.weight": torch.ones(e)}
    if not config.tie_word_embeddings:
        weights["lm_head.weight"] = normal(config.vocab_size, e, scale=head_std or std)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": torch.ones(e),
            p + "post_attention_layernorm.weight": torch.ones(e),
            p + "self_attn.q_proj.weight": normal(q, e),
            p + "self_attn.k_proj.weight": normal(kv, e),
            p + "self_attn.v_proj.weight": normal(kv, e),
            p + "self_attn.o_proj.weight": normal(e, q),
            p + "mlp.gate_proj.weight": normal(f, e),
            p + "mlp.up_proj.weight": normal(f, e),
            p + "mlp.down_proj.weight": normal(e, f),
        })
    return weights
