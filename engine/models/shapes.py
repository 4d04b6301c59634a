"""Known model shapes, and random weights for them.

Random weights of a real shape let GPU paths be tested and benchmarked without
moving a checkpoint: the compute per token is the real model's.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from formcast.engine.config import DeepseekV4Config, LlamaConfig

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


# DeepSeek-V4 shapes as ``config.json`` dictionaries (transformers' field names), so
# the same dictionary builds our model and transformers' reference. The vocabulary
# is SmolLM2's: its tokenizer is the one benchmarks carry.
DEEPSEEK_V4_SHAPES: dict[str, dict[str, Any]] = {
    # every part of the architecture at a size that keeps a GPU busy: the three
    # attention kinds, hash and score routing with a shared expert, 4 hyper-connection
    # streams; 341M parameters (201M of them in routed experts, 100M in the
    # embedding and head)
    "deepseek-v4-small": dict(
        vocab_size=49152, hidden_size=1024, moe_intermediate_size=512, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=1, head_dim=128, q_lora_rank=256,
        partial_rotary_factor=0.5, num_experts_per_tok=4, n_routed_experts=16,
        n_shared_experts=1,
        layer_types=["sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "hash_moe"] + ["moe"] * 6,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        hc_mult=4, hc_sinkhorn_iters=20, sliding_window=128, o_groups=4, o_lora_rank=256,
        index_n_heads=8, index_head_dim=64, index_topk=128, max_position_embeddings=8192,
        swiglu_limit=10.0, tie_word_embeddings=False),
    # the same layout, small enough for a CPU smoke run of the benchmark
    "deepseek-v4-tiny": dict(
        vocab_size=49152, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=32,
        partial_rotary_factor=0.5, num_experts_per_tok=2, n_routed_experts=4,
        n_shared_experts=1,
        layer_types=["sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        hc_mult=4, hc_sinkhorn_iters=6, sliding_window=16, o_groups=2, o_lora_rank=16,
        index_n_heads=4, index_head_dim=32, index_topk=8, max_position_embeddings=1024,
        swiglu_limit=10.0, tie_word_embeddings=False),
}


def randomize_deepseek_v4_(weights: dict[str, torch.Tensor], seed: int, n_experts: int) -> None:
    """Overwrite DeepSeek-V4 ``weights`` (transformers' names) in place with seeded
    values of a sensible scale: matrices N(0, 1/fan_in), norms and scales near 1,
    hash-routing tables valid expert ids, every bias and sink random (no part can
    hide behind an init of 0)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, w in sorted(weights.items()):
            if name.endswith("tid2eid"):
                w.copy_(torch.randint(0, n_experts, w.shape, generator=gen))
            elif name.endswith("norm.weight"):
                w.copy_(1 + 0.2 * torch.randn(w.shape, generator=gen))
            elif name.endswith((".scale", "hc_scale")):
                w.copy_(1 + 0.3 * torch.randn(w.shape, generator=gen))
            elif w.dim() >= 2 and not name.endswith("position_bias"):
                w.copy_(torch.randn(w.shape, generator=gen) / math.sqrt(w.shape[-1]))
            else:
                w.copy_(0.5 * torch.randn(w.shape, generator=gen))


def random_deepseek_v4_weights(config: dict[str, Any], *, seed: int = 0, with_mtp: bool = False
                               ) -> dict[str, torch.Tensor]:
    """Float32 weights under transformers' names (``mtp.0.*`` too with ``with_mtp``)
    for the ``config.json`` dictionary ``config``, seeded (see
    :func:`randomize_deepseek_v4_`). Made without transformers."""
    from formcast.engine.models.deepseek_v4 import DeepseekV4ForCausalLM, transformers_name

    parsed = DeepseekV4Config.from_dict(config)
    with torch.device("meta"):
        shell = DeepseekV4ForCausalLM(parsed, with_mtp=with_mtp)
    weights = {transformers_name(name): torch.empty(t.shape, dtype=t.dtype)
               for name, t in shell.state_dict().items()}
    randomize_deepseek_v4_(weights, seed, parsed.n_routed_experts)
    return weights


def family_shapes() -> dict[str, LlamaConfig]:
    """A small shape of each family on the Llama path (random-weight GPU runs):
    each family's details on, windows shorter than the prompts a run takes."""
    from formcast.engine.models.decoder_config import DecoderConfig

    base = dict(vocab_size=32768, hidden_size=512, intermediate_size=1536,
                num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2,
                head_dim=64, max_position_embeddings=4096)
    sliding = ("sliding_attention",) * 5 + ("full_attention",)
    return {
        "qwen2": DecoderConfig(**base, architecture="qwen2", qkv_bias=True),
        "qwen3": DecoderConfig(**{**base, "head_dim": 128}, architecture="qwen3", qk_norm=True,
                               tie_word_embeddings=True),
        "mistral": DecoderConfig(**base, architecture="mistral", sliding_window=96),
        "gemma3": DecoderConfig(
            **{**base, "head_dim": 256, "num_attention_heads": 4, "num_key_value_heads": 1},
            architecture="gemma3", qk_norm=True, norm_offset=1.0, sandwich_norms=True,
            embedding_scale=512 ** 0.5, hidden_act="gelu_pytorch_tanh", sliding_window=96,
            layer_types=sliding, local_rope_theta=10000.0, rope_theta=1e6,
            query_pre_attn_scalar=256.0, final_logit_softcapping=30.0, tie_word_embeddings=True),
        "phi3": DecoderConfig(**base, architecture="phi3", sliding_window=200, rope_scaling={
            "rope_type": "longrope", "original_max_position_embeddings": 1024,
            "short_factor": [1.0 + 0.02 * i for i in range(32)],
            "long_factor": [1.5 + 0.1 * i for i in range(32)]}),
    }


def random_family_weights(config: LlamaConfig, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Float32 weights of ``config`` (any family) under transformers' names:
    matrices N(0, 1/fan_in), the embedding N(0, 1) (peaked next-token
    distributions), norms near their scale of 1, biases N(0, 0.1)."""
    from formcast.engine.loader.hf import expected_shapes
    from formcast.engine.models.llama import decoder_config

    offset = decoder_config(config).norm_offset
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(config).items():
        w = torch.randn(*shape, generator=gen)
        if name.endswith("norm.weight"):
            w = (1.0 - offset) + 0.1 * w
        elif len(shape) == 2 and "embed" not in name and "lm_head" not in name:
            w = w / math.sqrt(shape[1])
        elif len(shape) == 1:
            w = 0.1 * w
        weights[name] = w
    return weights
