"""Tiny DeepSeek-V4 model folders for engine tests: transformers' ``save_pretrained``
of a seeded random model, an MTP layer of our own seeded weights, and a byte-level
BPE tokenizer over printable ASCII whose size is the model's vocabulary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tests.engine.deepseek_v4_helpers import TINY, randomize

EOS = "<|eos|>"
# merges on top of the 95 printable ASCII characters and EOS (96 tokens)
_MERGES = [("{", '"'), ('"', ":"), ('"', ","), ('"', "}"), (",", '"'), ("n", "a"), ("m", "e"),
           ("na", "me"), ("a", "g"), ("ag", "e"), ("t", "r"), ("u", "e"), ("tr", "ue"),
           ("Ġ", "t"), ("e", "r"), ("o", "n"), ("i", "n"), ("a", "n"), ("r", "e"), ("e", "s"),
           ("t", "h"), ("th", "e"), ("Ġ", "a"), ("Ġ", "the"), ("o", "r"), ("a", "l"), ("i", "s"),
           ("Ġ", "is"), ("1", "0"), ("0", "0"), ("l", "e"), ("s", "t")]
_BASE = 96

# Three configs that between them hold every layer type, both routings (hash and
# score, each with the shared expert), hc_mult 2, 3 and 4, and an MTP layer in two.
CONFIGS: dict[str, dict[str, Any]] = {
    "all_layers_mtp": dict(TINY, vocab_size=112, max_position_embeddings=256),
    "csa_sigmoid_yarn_mtp": dict(
        vocab_size=112, hidden_size=24, moe_intermediate_size=12, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, q_lora_rank=8,
        partial_rotary_factor=0.5, num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1,
        layer_types=["compressed_sparse_attention", "sliding_attention", "compressed_sparse_attention"],
        mlp_layer_types=["moe", "hash_moe", "moe"], scoring_func="sigmoid",
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        hc_mult=2, hc_sinkhorn_iters=4, sliding_window=6, o_groups=2, o_lora_rank=6,
        index_n_heads=4, index_head_dim=16, index_topk=2, max_position_embeddings=256,
        swiglu_limit=2.0),
    "hca_hc4": dict(
        vocab_size=128, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, q_lora_rank=12,
        partial_rotary_factor=0.5, num_experts_per_tok=3, n_routed_experts=5, n_shared_experts=1,
        layer_types=["heavily_compressed_attention", "sliding_attention",
                     "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 4},
        hc_mult=4, hc_sinkhorn_iters=5, sliding_window=5, o_groups=4, o_lora_rank=4,
        index_n_heads=2, index_head_dim=16, index_topk=2, max_position_embeddings=256,
        swiglu_limit=1.5),
}
WITH_MTP = {"all_layers_mtp", "csa_sigmoid_yarn_mtp"}


def reference(name: str, seed: int):
    """transformers' DeepseekV4ForCausalLM of config ``name``, every weight seeded random."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV4Config(**CONFIGS[name])
    config._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(config).eval()
    randomize(model.state_dict(), seed, config.n_routed_experts)
    return model


def mtp_weights(name: str, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random ``mtp.0.*`` weights for config ``name`` (transformers has none)."""
    from formcast.engine.config import DeepseekV4Config
    from formcast.engine.models.deepseek_v4 import DeepseekV4ForCausalLM

    config = DeepseekV4Config.from_dict(CONFIGS[name])
    with torch.device("meta"):
        shell = DeepseekV4ForCausalLM(config, with_mtp=True)
    weights = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in shell.state_dict().items()
               if k.startswith("mtp.0.")}
    randomize(weights, seed + 1000, config.n_routed_experts)
    return weights


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer of exactly ``vocab_size`` tokens: printable ASCII,
    EOS, then merges for JSON punctuation and a few words; a plain chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    # byte-level symbols: printable ASCII map to themselves, the space to "Ġ"
    pieces = ["Ġ" if c == " " else c for c in map(chr, range(32, 127))] + [EOS]
    merges = _MERGES[:vocab_size - _BASE]
    if len(pieces) + len(merges) != vocab_size:
        raise ValueError(f"cannot build a tokenizer of {vocab_size} tokens")
    vocab = {p: i for i, p in enumerate(pieces)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(EOS, special=True, normalized=False)])
    backend.save(str(folder / "tokenizer.json"))
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS,
                                                              "chat_template": template}))


def write_folder(folder: Path, name: str, seed: int):
    """Save config ``name`` (seeded) with its tokenizer, and MTP weights where the
    config has them; returns transformers' model (the reference)."""
    ref = reference(name, seed)
    ref.save_pretrained(folder)
    if name in WITH_MTP:
        file = folder / "model.safetensors"
        tensors = load_file(str(file))
        tensors.update(mtp_weights(name, seed))
        save_file(tensors, str(file), metadata={"format": "pt"})
    write_tokenizer(folder, CONFIGS[name]["vocab_size"])
    return ref
