"""Load an HF-layout folder: ``config.json`` plus one or more safetensors files.

Llama and the families that share its module (``model_type`` qwen2, qwen3,
mistral, gemma3_text / gemma3, phi3). The tensor names of the family's transformers
``*ForCausalLM`` state dict are formcast's canonical weight names;
:func:`expected_shapes` lists them for a config and the GGUF loader maps onto the
same table. A multimodal Gemma 3 folder gives its language model's weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from formcast.engine.config import LlamaConfig
from formcast.engine.errors import CorruptModelError, ModelNotFoundError, UnsupportedModelError
from formcast.engine.models.decoder_config import HF_MODEL_TYPES, DecoderConfig
from formcast.engine.models.llama import decoder_config

_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
_SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
# where a multimodal Gemma 3 checkpoint keeps its language model (two layouts)
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes (``[out_features, in_features]``) of every weight of ``config``.

    ``lm_head.weight`` is listed only when the head is untied. Phi-3's projections
    are its fused ``qkv_proj`` and ``gate_up_proj``.
    """
    spec = decoder_config(config)
    h, ff, d = config.hidden_size, config.intermediate_size, config.head_dim
    q_out = config.num_attention_heads * d
    kv_out = config.num_key_value_heads * d
    fused = spec.architecture == "phi3"
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        norms = ["input_layernorm", "post_attention_layernorm"]
        if spec.sandwich_norms:
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        shapes.update((f"{p}{norm}.weight", (h,)) for norm in norms)
        projections = ((("qkv_proj", q_out + 2 * kv_out),) if fused else
                       (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)))
        for proj, out in projections:
            shapes[f"{p}self_attn.{proj}.weight"] = (out, h)
            if spec.has_qkv_bias:
                shapes[f"{p}self_attn.{proj}.bias"] = (out,)
        if spec.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        if config.attention_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        mlp = ((("gate_up_proj", (2 * ff, h)),) if fused else
               (("gate_proj", (ff, h)), ("up_proj", (ff, h))))
        for proj, shape in mlp + (("down_proj", (h, ff)),):
            shapes[f"{p}mlp.{proj}.weight"] = shape
            if config.mlp_bias:
                shapes[f"{p}mlp.{proj}.bias"] = (shape[0],)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def check_weights(weights: dict[str, torch.Tensor], config: LlamaConfig, *, origin: Path) -> None:
    """Raise :class:`CorruptModelError` unless ``weights`` has exactly the expected names
    and shapes for ``config``; ``origin`` names the checkpoint in the message."""
    shapes = expected_shapes(config)
    unexpected = sorted(set(weights) - set(shapes))
    if unexpected:
        raise CorruptModelError(
            f"{origin}: unexpected weights {', '.join(unexpected[:5])} for this config")
    missing = [name for name in shapes if name not in weights]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CorruptModelError(
            f"{origin}: missing weights {', '.join(missing[:5])}{more}; the checkpoint is "
            "incomplete or does not match its config")
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != shape:
            raise CorruptModelError(
                f"{origin}: weight {name} has shape {tuple(weights[name].shape)}, but the config "
                f"implies {shape}")


def read_hf_config(folder: str | Path) -> LlamaConfig:
    """Read and validate ``config.json`` of an HF-layout folder of a supported family.

    Parameters
    ----------
    folder : str or Path
        Folder holding ``config.json``.

    Returns
    -------
    LlamaConfig
        A :class:`DecoderConfig` for a family other than Llama.

    Raises
    ------
    CorruptModelError
        ``config.json`` is missing, not JSON, or lacks a required field.
    UnsupportedModelError
        The config describes an architecture formcast does not run (the message
        lists those it does), or a setting of it formcast does not support.
    """
    path = Path(folder) / "config.json"
    try:
        raw: Any = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise CorruptModelError(f"{path.parent}: no config.json in the model folder") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptModelError(f"{path}: not a readable JSON file ({exc})") from exc
    if not isinstance(raw, dict):
        raise CorruptModelError(f"{path}: expected a JSON object, found {type(raw).__name__}")
    model_type = raw.get("model_type")
    architectures = raw.get("architectures") or []
    if model_type not in HF_MODEL_TYPES and \
            not any(a in _SUPPORTED_ARCHITECTURES for a in architectures):
        found = model_type or ", ".join(map(str, architectures)) or "none given"
        raise UnsupportedModelError(
            f"{path}: model type {found!r} is not supported; formcast runs model_type "
            f"{', '.join(map(repr, HF_MODEL_TYPES))} (architectures "
            f"{list(_SUPPORTED_ARCHITECTURES)} too)")
    try:
        if model_type in (None, "llama"):
            return LlamaConfig.from_hf_dict(raw)
        return DecoderConfig.from_hf_dict(raw)
    except KeyError as exc:
        raise CorruptModelError(f"{path}: required field {exc.args[0]!r} is missing") from exc
    except (TypeError, ValueError) as exc:
        raise CorruptModelError(f"{path}: invalid model config ({exc})") from exc


def _weight_files(folder: Path) -> list[Path]:
    single = folder / _SINGLE_FILE
    index = folder / _INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError,
                AttributeError) as exc:
            raise CorruptModelError(f"{index}: not a valid safetensors index ({exc!r})") from exc
        files = [folder / name for name in names]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CorruptModelError(
                f"{folder}: shard(s) {', '.join(absent)} listed in {_INDEX_FILE} are missing; "
                "download the complete model again")
        return files
    if single.is_file():
        return [single]
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise UnsupportedModelError(
            f"{folder}: only PyTorch pickle weights (*.bin / *.pt) found; formcast reads "
            "safetensors only. Convert with transformers: "
            "AutoModelForCausalLM.from_pretrained(folder).save_pretrained(folder)")
    raise CorruptModelError(
        f"{folder}: no weights found (expected {_SINGLE_FILE} or {_INDEX_FILE} next to "
        "config.json)")


def load_hf(folder: str | Path) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Read config and weights of an HF-layout folder, in the dtype they are stored in.

    Extra tensors a checkpoint may carry (``rotary_emb.inv_freq``, a tied
    ``lm_head.weight``) are dropped; missing ones raise.

    Raises
    ------
    ModelNotFoundError
        No such folder.
    CorruptModelError
        Config or weight files missing, unreadable, or inconsistent with each other.
    UnsupportedModelError
        A model type formcast does not run, or weights not in safetensors format.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelNotFoundError(f"{folder}: no such model folder")
    config = read_hf_config(folder)
    wanted = expected_shapes(config)
    weights: dict[str, torch.Tensor] = {}
    for file in _weight_files(folder):
        try:
            tensors = load_file(file, device="cpu")
        except (SafetensorError, OSError, ValueError) as exc:
            raise CorruptModelError(f"{file}: not a readable safetensors file ({exc})") from exc
        weights.update((n, t) for n, t in ((_text_name(name), t) for name, t in tensors.items())
                       if n in wanted)
    check_weights(weights, config, origin=folder)
    return config, weights


def _text_name(name: str) -> str:
    """A multimodal Gemma 3 tensor's name in the text model (others as they are)."""
    for prefix in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    return name
