"""Tiny random models of each family formcast runs on the Llama path, saved by
transformers (the reference) as HF folders and written as GGUF files the way
llama.cpp's converter lays them out (names, q/k row order, Gemma's ``1 + w``
norms, Phi-3's LongRoPE factor tensors), with the ``gguf`` package.

Windows are 8 tokens and prompts 24, so sliding layers see a fraction of the
context in every prefill and every decode step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

VOCAB = 128  # (the byte-level tokenizer of tests/engine/deepseek_v4_folders.py)
WINDOW = 8
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _configs(transformers) -> dict[str, Callable[[], object]]:
    """family case -> its transformers config (each detail of the family set off
    its default: biases, windows, a second RoPE, scaled queries, capped logits)."""
    sliding, full = "sliding_attention", "full_attention"
    return {
        "qwen2": lambda: transformers.Qwen2Config(**_COMMON, rope_theta=20000.0,
                                                  tie_word_embeddings=False),
        "qwen3": lambda: transformers.Qwen3Config(**_COMMON, head_dim=16,
                                                  tie_word_embeddings=True),
        "mistral": lambda: transformers.MistralConfig(**_COMMON, head_dim=16,
                                                      sliding_window=WINDOW),
        "gemma3": lambda: transformers.Gemma3TextConfig(
            **_COMMON, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
            layer_types=[sliding, sliding, full, sliding], final_logit_softcapping=30.0,
            rope_parameters={full: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                             sliding: {"rope_type": "default", "rope_theta": 1e4}}),
        # what llama.cpp's Gemma 3 assumes: five sliding layers to one full one,
        # queries scaled by the head dim, no RoPE scaling
        "gemma3_gguf": lambda: transformers.Gemma3TextConfig(
            **{**_COMMON, "num_hidden_layers": 6}, head_dim=16, query_pre_attn_scalar=16,
            sliding_window=WINDOW, final_logit_softcapping=30.0),
        "phi3": lambda: transformers.Phi3Config(
            **_COMMON, original_max_position_embeddings=64, sliding_window=12, pad_token_id=0,
            eos_token_id=None, bos_token_id=None,
            rope_scaling={"rope_type": "longrope",
                          "short_factor": [1.0 + 0.1 * i for i in range(8)],
                          "long_factor": [2.0 + 0.3 * i for i in range(8)]}),
    } | {"phi3_qkv": lambda: _configs(transformers)["phi3"]()}  # (q, k, v apart in its GGUF)


HF_CASES = ["qwen2", "qwen3", "mistral", "gemma3", "phi3"]
GGUF_CASES = ["qwen2", "qwen3", "mistral", "gemma3_gguf", "phi3", "phi3_qkv"]


def reference(transformers, case: str, seed: int = 0):
    """transformers' model of ``case`` with seeded weights of a scale that makes
    next-token distributions peaked (no near-ties for greedy decoding)."""
    model = transformers.AutoModelForCausalLM.from_config(
        _configs(transformers)[case](), attn_implementation="eager").eval()
    gemma = case.startswith("gemma")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:  # Gemma's norms scale by 1 + w
                p.copy_((0.0 if gemma else 1.0) + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 2:
                scale = 1.0 if "embed" in name or "lm_head" in name else math.sqrt(p.shape[1])
                p.copy_(torch.randn(p.shape, generator=gen) / scale)
            else:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    return model


# ----------------------------------------------------------------------- GGUF

_ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama", "gemma3_gguf": "gemma3",
         "phi3": "phi3", "phi3_qkv": "phi3"}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.qkv_proj": "attn_qkv", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "self_attn.o_proj": "attn_output",
          "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GEMMA_BLOCK = {"post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}


def _gguf_name(hf: str, arch: str) -> str:
    if hf.rsplit(".", 1)[0] in _GLOBAL:
        stem, kind = hf.rsplit(".", 1)
        return f"{_GLOBAL[stem]}.{kind}"
    _, _, layer, *rest = hf.split(".")
    module, kind = ".".join(rest[:-1]), rest[-1]
    table = {**_BLOCK, **(_GEMMA_BLOCK if arch == "gemma3" else {})}
    return f"blk.{layer}.{table[module]}.{kind}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order for its adjacent-pair RoPE (Llama files only)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _split_qkv(state: dict[str, torch.Tensor], c) -> dict[str, torch.Tensor]:
    """``state`` with each fused ``qkv_proj`` weight as q, k and v projections."""
    head_dim = c.hidden_size // c.num_attention_heads
    sizes = [c.num_attention_heads * head_dim] + [c.num_key_value_heads * head_dim] * 2
    out = {}
    for name, tensor in state.items():
        if ".qkv_proj." not in name:
            out[name] = tensor
            continue
        for part, piece in zip(("q_proj", "k_proj", "v_proj"), tensor.split(sizes)):
            out[name.replace("qkv_proj", part)] = piece
    return out


def write_gguf(path: Path, model, case: str, qtype: str = "F32", *,
               tokenizer: bool = False) -> None:
    """Write ``model`` (a :func:`reference` of ``case``) as a GGUF, its matrices
    in ``qtype`` blocks (a type :func:`gguf.quants.quantize` writes), the rest
    float32; ``tokenizer``: with a byte-level BPE vocabulary (``<i>`` tokens) in
    its metadata, for loaders that read one."""
    import gguf
    from gguf.quants import quantize

    c, arch = model.config, _ARCH[case]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim if hasattr(c, "head_dim") else c.hidden_size // c.num_attention_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(["a", "b", "ab"] + [f"<{i}>" for i in range(3, c.vocab_size)])
        w.add_token_merges(["a b"])  # (one: the writer leaves an empty list out)
    rope = c.rope_parameters
    rope = rope.get("full_attention", rope)
    w.add_rope_freq_base(rope["rope_theta"])
    if getattr(c, "sliding_window", None):
        w.add_sliding_window(c.sliding_window)
    if getattr(c, "final_logit_softcapping", None):
        w.add_float32(f"{arch}.final_logit_softcapping", c.final_logit_softcapping)
    if rope.get("rope_type") == "longrope":
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    state = model.state_dict()
    if c.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if case == "phi3_qkv":  # (llama.cpp's other Phi-3 layout: attn_q, attn_k, attn_v)
        state = _split_qkv(state, c)
    for hf, tensor in state.items():
        arr = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in hf:
            arr = _permute(arr, c.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf:
            arr = _permute(arr, c.num_key_value_heads)
        elif arch == "gemma3" and hf.endswith("norm.weight"):
            arr = arr + 1  # (llama.cpp's Gemma norms multiply by the stored weight)
        arr = np.ascontiguousarray(arr)
        if qtype != "F32" and arr.ndim == 2:
            kind = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(_gguf_name(hf, arch), quantize(arr, kind), raw_dtype=kind)
        else:
            w.add_tensor(_gguf_name(hf, arch), arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
