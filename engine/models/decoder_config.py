"""Shape of a Llama-like decoder of another family: what sets Qwen2/2.5, Qwen3,
Mistral, Gemma 3 and Phi-3 apart from Llama, as fields on top of
:class:`~formcast.engine.config.LlamaConfig` (so everything that runs a Llama
config runs these), and their reading from transformers' ``config.json``.

Field names follow transformers where it has one; ``architecture`` names the
family (``"qwen2"``, ``"qwen3"``, ``"mistral"``, ``"gemma3"``, ``"phi3"``, or
``"llama"`` for a Llama GGUF that carries a sliding window).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from formcast.engine.config import LlamaConfig

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

# config.json model_type -> the family formcast runs it as
HF_MODEL_TYPES: dict[str, str] = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "mistral": "mistral",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "phi3": "phi3",
}


@dataclass(frozen=True, kw_only=True)
class DecoderConfig(LlamaConfig):
    """A Llama config plus the details in which the other families differ.

    Attributes
    ----------
    qkv_bias : bool or None
        Whether the q, k and v projections have a bias (Qwen2: they do, the
        output projection does not). None: as ``attention_bias``.
    qk_norm : bool
        An RMSNorm over each query and key head before the rotation (Qwen3, Gemma 3).
    norm_offset : float
        Norms scale by ``norm_offset + weight`` (Gemma's ``1 + w``).
    sandwich_norms : bool
        Norms after the attention and the MLP as well as before them (Gemma 3).
    embedding_scale : float or None
        Embeddings are multiplied by this (Gemma: ``sqrt(hidden_size)``).
    hidden_act : str
        The gate's activation: ``"silu"`` or ``"gelu_pytorch_tanh"``.
    sliding_window : int or None
        Keys a sliding-window layer sees: its query's own and the ``sliding_window - 1``
        before it.
    layer_types : tuple of str or None
        ``"full_attention"`` or ``"sliding_attention"`` a layer; None: every layer
        slides when ``sliding_window`` is set.
    local_rope_theta : float or None
        RoPE base of the sliding layers (Gemma 3), which take no RoPE scaling;
        None: the same RoPE as the full layers.
    query_pre_attn_scalar : float or None
        Attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` rather
        than ``head_dim ** -0.5``.
    attn_logit_softcapping, final_logit_softcapping : float or None
        ``c * tanh(x / c)`` on attention scores / on the output logits.
    """

    qkv_bias: bool | None = None
    qk_norm: bool = False
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    embedding_scale: float | None = None
    hidden_act: str = "silu"
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    local_rope_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported "
                             f"(supported: {', '.join(ACTIVATIONS)})")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.layer_types is not None:
            if not isinstance(self.layer_types, tuple):
                object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                                 f"{self.num_hidden_layers} layers")
            bad = sorted(set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
            if bad:
                raise ValueError(f"unknown layer types {bad} (known: {FULL_ATTENTION}, "
                                 f"{SLIDING_ATTENTION})")
        for name in ("attn_logit_softcapping", "final_logit_softcapping",
                     "query_pre_attn_scalar"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")

    def is_sliding(self, layer: int) -> bool:
        """Whether layer ``layer`` attends within :attr:`sliding_window`."""
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[layer] == SLIDING_ATTENTION

    def window(self, layer: int) -> int | None:
        """Keys layer ``layer`` sees at most (None: the whole context)."""
        return self.sliding_window if self.is_sliding(layer) else None

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def has_qkv_bias(self) -> bool:
        return self.attention_bias if self.qkv_bias is None else self.qkv_bias

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DecoderConfig":
        """From :func:`dataclasses.asdict`'s dictionary (a JSON round trip): unknown
        keys are dropped, lists become tuples."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v
                      for k, v in d.items() if k in names})

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "DecoderConfig":
        """Build from a transformers ``config.json`` dictionary of a supported
        ``model_type`` (:data:`HF_MODEL_TYPES`; a multimodal Gemma 3 config's
        ``text_config`` is read).

        Raises ``KeyError`` for a missing required field and ``ValueError`` for an
        unsupported model type or setting.
        """
        model_type = d.get("model_type", "llama")
        if model_type not in HF_MODEL_TYPES:
            raise ValueError(f"model type {model_type!r} is not supported")
        family = HF_MODEL_TYPES[model_type]
        if model_type == "gemma3":
            d = {**d.get("text_config", {}), "model_type": "gemma3_text",
                 "tie_word_embeddings": d.get("tie_word_embeddings", True)}
        rope = d.get("rope_parameters") or {}
        base = {f.name: getattr(LlamaConfig.from_hf_dict({**d, "rope_parameters": rope.get(
            FULL_ATTENTION, rope)}), f.name) for f in fields(LlamaConfig)}
        base["architecture"] = family
        extra: dict[str, Any] = {"sliding_window": d.get("sliding_window"),
                                 "hidden_act": d.get("hidden_act") or "silu"}
        types = d.get("layer_types")
        if types is not None:
            extra["layer_types"] = tuple(types)
        partial = d.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
        if partial != 1.0:
            raise ValueError(f"partial rotary embedding (partial_rotary_factor {partial}) "
                             "is not supported")
        if family in ("qwen2", "qwen3"):
            # Qwen's windows are off unless use_sliding_window, and then only from
            # layer max_window_layers on (config.json may name a window either way)
            if not d.get("use_sliding_window", False):
                extra["sliding_window"] = None
                extra.pop("layer_types", None)
            elif types is None:
                first = d.get("max_window_layers", 0)
                extra["layer_types"] = tuple(
                    SLIDING_ATTENTION if i >= first else FULL_ATTENTION
                    for i in range(d["num_hidden_layers"]))
            extra["qkv_bias" if family == "qwen2" else "qk_norm"] = True
            # (Qwen2's q, k, v have biases, its o_proj none; Qwen3 norms q and k heads)
        elif family == "gemma3":
            if d.get("use_bidirectional_attention"):
                raise ValueError("bidirectional attention (use_bidirectional_attention) "
                                 "is not supported")
            local = rope.get(SLIDING_ATTENTION) or {}
            base["tie_word_embeddings"] = d.get("tie_word_embeddings", True)
            base["rms_norm_eps"] = d.get("rms_norm_eps", 1e-6)
            extra.update(
                qk_norm=True, norm_offset=1.0, sandwich_norms=True,
                embedding_scale=math.sqrt(d["hidden_size"]),
                hidden_act=d.get("hidden_activation") or d.get("hidden_act") or
                "gelu_pytorch_tanh",
                local_rope_theta=float(local.get("rope_theta") or
                                       d.get("rope_local_base_freq") or 10000.0),
                query_pre_attn_scalar=d.get("query_pre_attn_scalar", 256),
                # (Gemma 3 configs may name an attention cap, but neither transformers'
                # Gemma 3 nor llama.cpp's applies it: Gemma 2 did)
                final_logit_softcapping=d.get("final_logit_softcapping"))
            if local.get("rope_type", "default") != "default":
                raise ValueError("RoPE scaling on Gemma 3's sliding layers is not supported")
            if types is None:
                pattern = d.get("sliding_window_pattern", 6)
                extra["layer_types"] = tuple(
                    SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION
                    for i in range(d["num_hidden_layers"]))
        scaling = base["rope_scaling"]
        if scaling is not None and "original_max_position_embeddings" not in scaling and \
                "original_max_position_embeddings" in d:
            base["rope_scaling"] = {**scaling, "original_max_position_embeddings":
                                    d["original_max_position_embeddings"]}
        if extra["hidden_act"] == "gelu_tanh":
            extra["hidden_act"] = "gelu_pytorch_tanh"
        return cls(**base, **extra)
