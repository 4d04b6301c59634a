"""What a GGUF's ``general.architecture`` means for formcast: the family's config
from the file's metadata, and its tensor names in transformers' terms.

llama.cpp's converters store some tensors in their own form; reading undoes it:
- ``llama`` (Llama, Mistral): q/k projection rows permuted for llama.cpp's
  adjacent-pair RoPE (undone in :mod:`formcast.engine.loader.gguf`).
- ``gemma3``: every norm weight stored as ``1 + w`` (llama.cpp multiplies by it
  directly); the window pattern (five sliding layers to one full), the sliding
  layers' RoPE base (10000) and the query scale (``key_length ** -0.5``) are
  llama.cpp's fixed choices unless the file says otherwise.
- ``phi3``: LongRoPE's factors as tensors ``rope_factors_long/short.weight``; the
  attention projections fused (``attn_qkv``) or apart (``attn_q/k/v``, fused on load).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from formcast.engine.config import LlamaConfig
from formcast.engine.models.decoder_config import FULL_ATTENTION, SLIDING_ATTENTION, DecoderConfig

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "phi3")
# tensors that configure rather than weigh (Phi-3's LongRoPE factors)
ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# where a family's names differ: Gemma 3 norms around both halves; Phi-3 fuses gate|up
_ARCH_BLOCK_NAMES = {
    "gemma3": {"post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The transformers name of a llama.cpp tensor name in a file of ``arch``, or
    None if it is not a weight of that family."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None:
        return None
    names = {**_BLOCK_NAMES, **_ARCH_BLOCK_NAMES.get(arch, {})}
    if m.group(2) not in names:
        return None
    return f"model.layers.{int(m.group(1))}.{names[m.group(2)]}.{m.group(3)}"


def stored_to_hf(arch: str, name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """How tensor ``name`` (transformers') of an ``arch`` file becomes transformers'
    value, beyond dequantization (None: as stored). The q/k row order of ``llama``
    files is the loader's (it needs the head counts)."""
    if arch == "gemma3" and name.endswith("norm.weight"):
        return lambda w: w - 1
    return None


def family_config(arch: str, base: dict[str, Any], value: Callable[[str], Any],
                  names: set[str], tensor: Callable[[str], np.ndarray]) -> LlamaConfig:
    """The config of a file of ``arch``: ``base`` holds the :class:`LlamaConfig`
    fields read the same way for every architecture, ``value(key)`` a metadata
    value (None when absent; keys without the ``arch.`` prefix), ``names`` the
    tensor names, ``tensor(name)`` a tensor's stored values.

    Raises ``ValueError`` for metadata formcast cannot run.
    """
    window = value("attention.sliding_window")
    extra: dict[str, Any] = {"sliding_window": None if window is None else int(window)}
    if arch == "llama":
        if window is None:
            return LlamaConfig(**base)
        return DecoderConfig(**base, **extra)  # (a Mistral with its window)
    if arch in ("qwen2", "qwen3"):
        base["attention_bias"] = "blk.0.attn_output.bias" in names
        extra["qkv_bias"] = "blk.0.attn_q.bias" in names or "blk.0.attn_qkv.bias" in names
        extra["qk_norm"] = "blk.0.attn_q_norm.weight" in names
    elif arch == "gemma3":
        layers = base["num_hidden_layers"]
        pattern = int(value("attention.sliding_window_pattern") or 6)
        cap = value("final_logit_softcapping")
        extra.update(
            qk_norm=True, norm_offset=1.0, sandwich_norms=True,
            embedding_scale=math.sqrt(base["hidden_size"]), hidden_act="gelu_pytorch_tanh",
            layer_types=tuple(SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION
                              for i in range(layers)),
            local_rope_theta=float(value("rope.freq_base_swa") or 10000.0),
            query_pre_attn_scalar=float(base["head_dim"]),
            final_logit_softcapping=None if cap is None else float(cap))
    elif arch == "phi3":
        if all(n in names for n in ROPE_FACTOR_TENSORS):
            scaling: dict[str, Any] = {
                "rope_type": "longrope",
                "long_factor": tensor("rope_factors_long.weight").astype(float).tolist(),
                "short_factor": tensor("rope_factors_short.weight").astype(float).tolist(),
                "original_max_position_embeddings": int(
                    value("rope.scaling.original_context_length") or base["max_position_embeddings"])}
            factor = value("rope.scaling.attn_factor")
            if factor is not None:
                scaling["attention_factor"] = float(factor)
            base["rope_scaling"] = scaling
    else:
        raise ValueError(f"architecture {arch!r} is not one of {SUPPORTED_ARCHITECTURES}")
    return DecoderConfig(**{**base, "architecture": arch}, **extra)
