"""Tiny seeded DeepSeek-V4 models for tests: transformers' reference and ours."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from formcast.engine.models.shapes import randomize_deepseek_v4_ as randomize

TINY: dict[str, Any] = dict(
    vocab_size=97, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=1, head_dim=16, q_lora_rank=12,
    partial_rotary_factor=0.5, num_experts_per_tok=2, n_routed_experts=6, n_shared_experts=1,
    layer_types=["sliding_attention", "compressed_sparse_attention",
                 "heavily_compressed_attention", "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe", "moe", "moe", "hash_moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    hc_mult=3, hc_sinkhorn_iters=6, sliding_window=8, o_groups=2, o_lora_rank=8,
    index_n_heads=8, index_head_dim=16, index_topk=3, max_position_embeddings=512,
    swiglu_limit=1.5,
)


def reference_model(seed: int = 0, **overrides: Any):
    """transformers' DeepseekV4ForCausalLM with every weight random (float32, eval)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV4Config(**{**TINY, **overrides})
    config._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(config).eval()
    randomize(model.state_dict(), seed, config.n_routed_experts)
    return model


def our_model(reference):
    """Our model built from the reference's config.json dict and state dict."""
    from formcast.engine.config import DeepseekV4Config
    from formcast.engine.models.deepseek_v4 import DeepseekV4ForCausalLM

    config = DeepseekV4Config.from_dict(reference.config.to_dict())
    model = DeepseekV4ForCausalLM(config).eval()
    model.load_weights(dict(reference.state_dict()))
    return model


def run_chunks(model, tokens: torch.Tensor, sizes: list[int], state=None) -> torch.Tensor:
    """Feed one sequence in chunks of ``sizes``; float32 logits ``[sum(sizes), V]``."""
    state = state if state is not None else model.new_state()
    out, start = [], state.num_tokens
    for n in sizes:
        ids = tokens[start:start + n]
        pos = torch.arange(start, start + n)
        out.append(model.logits(model(ids, pos, [state], [n])))
        start += n
    return torch.cat(out)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny ops on a shared 2-core machine: one thread is ~20x faster than two.
    Import it into a test module to use it there."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
