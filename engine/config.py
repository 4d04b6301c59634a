"""Configuration dataclasses: the model's shape and the engine's knobs.

Both are frozen and keyword-only. Values only known at run time (the number of KV
blocks that fit, eos ids read from the tokenizer) live in runtime state, never here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape of a Llama-family decoder (names follow transformers' LlamaConfig)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    architecture: str = "llama"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"LlamaConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        """Build from a transformers ``config.json`` dictionary."""
        heads = d["num_attention_heads"]
        # transformers >= 5 writes RoPE settings (theta and any scaling) as rope_parameters.
        rope_params = d.get("rope_parameters") or {}
        rope_scaling = d.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=d.get("rope_theta") or rope_params.get("rope_theta") or 10000.0,
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", False),
            mlp_bias=d.get("mlp_bias", False),
        )


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Knobs of the engine; every field has a sensible default.

    Parameters
    ----------
    block_size : int
        Tokens per KV-cache block.
    num_kv_blocks : int | None
        KV blocks to allocate; None sizes the cache from ``kv_cache_memory``.
    kv_cache_memory : int
        Bytes for the KV cache when ``num_kv_blocks`` is None.
    max_num_seqs : int
        Most requests in one running batch.
    max_num_batched_tokens : int
        Token budget of one step (prefill chunks plus decode tokens).
    max_model_len : int | None
        Longest sequence (prompt + output); None takes the model's context length.
    enable_prefix_caching : bool
        Share KV blocks between requests whose prompts start alike.
    spec : SpecConfig | str | None
        Speculative decoding (:class:`formcast.engine.spec.SpecConfig`, or a method
        name: "auto", "prompt_lookup", "none"). Default "auto": greedy requests
        draft while few requests run; outputs are identical either way.
    max_constraint_rollbacks : int
        How often one request may back out of a dead end its constraint can explain
        (``rollback_hint()``: a finished value failed an end check) by rolling back
        to the offending value and sampling again with the token that led there
        banned. 0 turns recovery off: such a request ends at once with an error.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int = 512 * 2**20
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    max_constraint_rollbacks: int = 8
    spec: Any = None  # SpecConfig after __post_init__

    def __post_init__(self) -> None:
        from formcast.engine.spec.config import SpecConfig

        object.__setattr__(self, "spec", SpecConfig.coerce(self.spec))
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.max_constraint_rollbacks < 0:
            raise ValueError(f"max_constraint_rollbacks must be >= 0, got "
                             f"{self.max_constraint_rollbacks}")
