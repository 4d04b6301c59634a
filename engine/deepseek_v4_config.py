"""DeepSeek-V4's model shape: its layer kinds, RoPE tables and config (read from an
HF ``config.json``); the other families' shape is :class:`formcast.engine.config.LlamaConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


DEEPSEEK_V4_LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention",
                           "heavily_compressed_attention")
DEEPSEEK_V4_MLP_TYPES = ("hash_moe", "moe")
_LEGACY_RATIO_TO_LAYER_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention",
                               128: "heavily_compressed_attention"}


@dataclass(frozen=True, kw_only=True)
class RopeSpec:
    """One RoPE table of DeepSeek-V4: plain, or YaRN-scaled when ``factor`` is set.

    ``attention_factor`` multiplies cos/sin (YaRN's mscale); V4 keeps it at 1.0 for its
    compressed layers unless the checkpoint says otherwise.
    """

    theta: float
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.theta <= 0:
            raise ValueError(f"RopeSpec.theta must be positive, got {self.theta}")
        if self.factor is not None and (self.factor <= 0 or not self.original_max_position_embeddings):
            raise ValueError("a YaRN RopeSpec needs factor > 0 and original_max_position_embeddings, "
                             f"got factor={self.factor}, original_max_position_embeddings="
                             f"{self.original_max_position_embeddings}")

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, theta: float, max_positions: int,
                  default_attention_factor: float | None) -> "RopeSpec":
        """Build from a transformers ``rope_parameters`` entry (``rope_type`` default or yarn).

        Without an ``attention_factor`` in ``d``, YaRN takes ``default_attention_factor``,
        or when that is None the mscale formula (``0.1 ln(factor) + 1``, or the ratio of
        two such terms when ``mscale``/``mscale_all_dim`` are given).
        """
        kind = d.get("rope_type", d.get("type", "default"))
        theta = float(d.get("rope_theta", theta))
        if kind == "default":
            return cls(theta=theta)
        if kind != "yarn":
            raise ValueError(f"rope_parameters: unsupported rope_type {kind!r} for DeepSeek-V4 "
                             "(supported: default, yarn)")
        original = d.get("original_max_position_embeddings")
        factor = d.get("factor")
        if factor is None and original:
            factor = max_positions / original
        attention_factor = d.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all = d.get("mscale"), d.get("mscale_all_dim")
            if default_attention_factor is not None:
                attention_factor = default_attention_factor
            elif mscale and mscale_all:
                attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
            else:
                attention_factor = _yarn_mscale(factor)
        return cls(theta=theta, factor=factor, original_max_position_embeddings=original,
                   beta_fast=float(d.get("beta_fast") or 32.0),
                   beta_slow=float(d.get("beta_slow") or 1.0),
                   attention_factor=float(attention_factor), truncate=d.get("truncate", True))


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    import math  # (this module's imports stay as they were; only this helper needs it)

    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True, kw_only=True)
class DeepseekV4Config:
    """Shape of a DeepSeek-V4 decoder (names follow transformers' DeepseekV4Config).

    ``layer_types[i]`` is the attention of layer i (sliding window only, compressed
    sparse attention = CSA, heavily compressed attention = HCA); ``mlp_layer_types[i]``
    its expert routing (``hash_moe``: fixed token-id table, ``moe``: learned scores).
    ``rope_main`` serves sliding layers, ``rope_compress`` CSA/HCA layers and their
    compressors. ``qk_rope_head_dim`` trailing channels of each head are rotated.
    """

    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    qk_rope_head_dim: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    rope_main: RopeSpec = RopeSpec(theta=10000.0)
    rope_compress: RopeSpec = RopeSpec(theta=160000.0)
    compress_rate_csa: int = 4
    compress_rate_hca: int = 128
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_nextn_predict_layers: int = 1
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    architecture: str = "deepseek_v4"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "head_dim", "q_lora_rank", "num_experts_per_tok",
                     "n_routed_experts", "compress_rate_csa", "compress_rate_hca", "hc_mult",
                     "hc_sinkhorn_iters", "sliding_window", "o_groups", "o_lora_rank",
                     "index_n_heads", "index_head_dim", "index_topk", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"DeepseekV4Config.{name} must be positive, got {getattr(self, name)}")
        if self.num_nextn_predict_layers < 0:
            raise ValueError("DeepseekV4Config.num_nextn_predict_layers must be >= 0, got "
                             f"{self.num_nextn_predict_layers}")
        for name, types, allowed in (("layer_types", self.layer_types, DEEPSEEK_V4_LAYER_TYPES),
                                     ("mlp_layer_types", self.mlp_layer_types, DEEPSEEK_V4_MLP_TYPES)):
            if len(types) != self.num_hidden_layers:
                raise ValueError(f"DeepseekV4Config.{name} has {len(types)} entries, expected "
                                 f"num_hidden_layers={self.num_hidden_layers}")
            bad = sorted({t for t in types if t not in allowed})
            if bad:
                raise ValueError(f"DeepseekV4Config.{name}: unknown entries {bad} (allowed: {allowed})")
        if not 0 < self.qk_rope_head_dim <= min(self.head_dim, self.index_head_dim) \
                or self.qk_rope_head_dim % 2:
            raise ValueError(f"DeepseekV4Config.qk_rope_head_dim must be even and within head_dim "
                             f"({self.head_dim}) and index_head_dim ({self.index_head_dim}), got "
                             f"{self.qk_rope_head_dim}")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ValueError(f"DeepseekV4Config.o_groups ({self.o_groups}) must divide "
                             f"num_attention_heads * head_dim ({self.num_attention_heads * self.head_dim})")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(f"DeepseekV4Config.num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                             f"n_routed_experts ({self.n_routed_experts})")
        if self.n_shared_experts != 1:
            raise ValueError("DeepseekV4Config.n_shared_experts must be 1 (one shared expert of "
                             f"moe_intermediate_size, as DeepSeek-V4 ships), got {self.n_shared_experts}")
        if self.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
            raise ValueError(f"DeepseekV4Config.scoring_func must be sqrtsoftplus, sigmoid or softmax, "
                             f"got {self.scoring_func!r}")

    def compress_rate(self, layer: int) -> int:
        """Source tokens per compressed entry of ``layer`` (0 for sliding-only layers)."""
        kind = self.layer_types[layer]
        if kind == "compressed_sparse_attention":
            return self.compress_rate_csa
        if kind == "heavily_compressed_attention":
            return self.compress_rate_hca
        return 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DeepseekV4Config":
        """Build from a ``config.json`` dictionary, as transformers writes it or in the
        original DeepSeek layout (``compress_ratios``, ``num_hash_layers``,
        ``qk_rope_head_dim``, flat ``rope_scaling``).

        Raises ``ValueError`` naming a missing or invalid field.
        """
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers") if k not in d]
        if missing:
            raise ValueError(f"DeepSeek-V4 config.json lacks required fields {missing}")
        n = d["num_hidden_layers"]
        heads = d.get("num_attention_heads", 64)
        if d.get("num_key_value_heads", 1) != 1:
            raise ValueError("DeepSeek-V4 attention shares one KV head: num_key_value_heads must be 1, "
                             f"got {d['num_key_value_heads']}")
        head_dim = d.get("head_dim", 512)
        rates = dict(d.get("compress_rates") or {})
        csa = d.get("compress_rate_csa", rates.get("compressed_sparse_attention", 4))
        hca = d.get("compress_rate_hca", rates.get("heavily_compressed_attention", 128))
        layer_types = d.get("layer_types")
        if layer_types is None and d.get("compress_ratios") is not None:
            ratios = d["compress_ratios"]
            bad = sorted({r for r in ratios if r not in _LEGACY_RATIO_TO_LAYER_TYPE})
            if bad:
                raise ValueError(f"compress_ratios: unknown ratios {bad} (allowed: 0, 4, 128)")
            layer_types = [_LEGACY_RATIO_TO_LAYER_TYPE[r] for r in ratios]
        if layer_types is None:
            layer_types = (["heavily_compressed_attention"] * min(n, 2)
                           + ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                              for i in range(max(n - 2, 0))])
        mlp_types = d.get("mlp_layer_types")
        if mlp_types is None:
            n_hash = d.get("num_hash_layers", 3)
            mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
        if d.get("partial_rotary_factor") is not None:
            rope_dim = int(head_dim * d["partial_rotary_factor"])
        else:
            rope_dim = d.get("qk_rope_head_dim", head_dim // 8)
        max_pos = d.get("max_position_embeddings", 1048576)
        main, compress, nested = _v4_rope_dicts(d)
        try:
            return cls(
                vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
                moe_intermediate_size=d.get("moe_intermediate_size", 2048),
                num_hidden_layers=n, num_attention_heads=heads, head_dim=head_dim,
                q_lora_rank=d.get("q_lora_rank", 1024), qk_rope_head_dim=rope_dim,
                layer_types=tuple(layer_types[:n]), mlp_layer_types=tuple(mlp_types[:n]),
                num_experts_per_tok=d.get("num_experts_per_tok", 6),
                n_routed_experts=d.get("n_routed_experts", 256),
                n_shared_experts=d.get("n_shared_experts", 1),
                scoring_func=d.get("scoring_func", "sqrtsoftplus"),
                norm_topk_prob=d.get("norm_topk_prob", True),
                routed_scaling_factor=d.get("routed_scaling_factor", 1.5),
                rope_main=RopeSpec.from_dict(main, theta=d.get("rope_theta", 10000.0),
                                             max_positions=max_pos, default_attention_factor=None),
                # A flat YaRN block is V4's compressed-layer scaling, whose cos/sin the
                # original code does not multiply by mscale.
                rope_compress=RopeSpec.from_dict(
                    compress, theta=d.get("compress_rope_theta", 160000.0),
                    max_positions=max_pos, default_attention_factor=None if nested else 1.0),
                compress_rate_csa=csa, compress_rate_hca=hca,
                hc_mult=d.get("hc_mult", 4), hc_sinkhorn_iters=d.get("hc_sinkhorn_iters", 20),
                hc_eps=d.get("hc_eps", 1e-6), swiglu_limit=d.get("swiglu_limit", 10.0),
                sliding_window=d.get("sliding_window", 128), o_groups=d.get("o_groups", 8),
                o_lora_rank=d.get("o_lora_rank", 1024), index_n_heads=d.get("index_n_heads", 64),
                index_head_dim=d.get("index_head_dim", 128), index_topk=d.get("index_topk", 512),
                num_nextn_predict_layers=d.get("num_nextn_predict_layers", 1),
                rms_norm_eps=d.get("rms_norm_eps", 1e-6), max_position_embeddings=max_pos,
                tie_word_embeddings=d.get("tie_word_embeddings", False),
            )
        except TypeError as e:  # a field of the wrong type (a list where a number belongs)
            raise ValueError(f"DeepSeek-V4 config.json has a field of the wrong type: {e}") from e


def _v4_rope_dicts(d: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """The (main, compress) RoPE dictionaries of a V4 config and whether they came
    nested (``rope_parameters`` as transformers writes it); a flat
    ``rope_parameters``/``rope_scaling`` applies (YaRN included) to the compressed
    layers only."""
    rp = d.get("rope_parameters") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return rp["main"], rp["compress"], True
    flat = {k: v for k, v in (d.get("rope_scaling") or rp).items() if k not in ("main", "compress")}
    flat.pop("rope_theta", None)
    return {"rope_type": "default"}, flat, False
