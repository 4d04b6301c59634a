"""Load a DeepSeek-V4 folder: ``config.json`` plus safetensors, into float32 weights
under transformers' ``DeepseekV4ForCausalLM`` names (``mtp.0.*`` for the MTP layer).

Names are read per tensor, so every mix of these works:

- transformers' module names (``model.layers.0.self_attn.q_a_proj.weight``), FP8
  ones with ``<name>_scale_inv`` / ``<module>.weight_scale_inv`` companions;
- DeepSeek's original release names (``embed.weight``, ``layers.0.attn.wq_a.weight``,
  ``layers.0.ffn.experts.3.w1.weight``, ``mtp.0.e_proj.weight``, scales as
  ``<module>.scale``), with or without a leading ``model.``: transformers 5's
  ``save_pretrained`` runs its conversion mapping backwards and writes
  ``model.layers.0.attn.wq_a.weight``, ``head.weight`` and the like.

The renames are those of transformers' ``deepseek_v4`` conversion mapping
(``conversion_mapping.py``, written here as our own table), plus the MTP layer's names,
which transformers drops; per-expert ``w1``/``w3``/``w2`` are stacked into
``gate_up_proj``/``down_proj``. A name in neither scheme is passed through, and the
model's ``load_weights`` rejects it.

Quantized tensors (FP8 128x128 blocks, FP4 experts) are dequantized at load
(:mod:`formcast.engine.loader.blockquant`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from formcast.engine.config import DeepseekV4Config
from formcast.engine.loader.blockquant import FP8_BLOCK, dequantize_fp4, dequantize_fp8
from formcast.engine.loader.hf import _weight_files
from formcast.engine.errors import CorruptModelError, ModelNotFoundError, UnsupportedModelError

_COMPRESSOR_LEAVES = {"wkv.weight": "kv_proj.weight", "wgate.weight": "gate_proj.weight",
                      "ape": "position_bias", "norm.weight": "kv_norm.weight"}
_ATTN_LEAVES = {"wq_a": "q_a_proj", "q_norm": "q_a_norm", "wq_b": "q_b_proj", "wkv": "kv_proj",
                "kv_norm": "kv_norm", "wo_a": "o_a_proj", "wo_b": "o_b_proj"}
_SHARED_LEAVES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_MTP_ONLY = ("enorm.weight", "hnorm.weight", "e_proj.weight", "h_proj.weight", "norm.weight")
_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.(w[123])\.weight")
_BLOCK_RULES: tuple[tuple[re.Pattern[str], Any], ...] = tuple((re.compile(p), r) for p, r in (
    (r"attn_norm\.weight", "input_layernorm.weight"),
    (r"ffn_norm\.weight", "post_attention_layernorm.weight"),
    (r"hc_(attn|ffn)_(fn|base|scale)", lambda m: f"{m[1]}_hc.{m[2]}"),
    (r"attn\.attn_sink", "self_attn.sinks"),
    (r"attn\.indexer\.compressor\.(.+)",
     lambda m: f"self_attn.compressor.indexer.{_COMPRESSOR_LEAVES[m[1]]}"),
    (r"attn\.compressor\.(.+)", lambda m: f"self_attn.compressor.{_COMPRESSOR_LEAVES[m[1]]}"),
    (r"attn\.indexer\.wq_b\.weight", "self_attn.compressor.indexer.q_b_proj.weight"),
    (r"attn\.indexer\.weights_proj\.weight", "self_attn.compressor.indexer.scorer.weights_proj.weight"),
    (r"attn\.norm\.weight", "self_attn.kv_norm.weight"),  # as save_pretrained writes kv_norm
    (r"attn\.(\w+)\.weight", lambda m: f"self_attn.{_ATTN_LEAVES[m[1]]}.weight"),
    (r"ffn\.gate\.weight", "mlp.gate.weight"),
    (r"ffn\.gate\.bias", "mlp.gate.e_score_correction_bias"),
    (r"ffn\.gate\.tid2eid", "mlp.gate.tid2eid"),
    (r"ffn\.shared_experts\.(w[123])\.weight", lambda m: f"mlp.shared_experts.{_SHARED_LEAVES[m[1]]}.weight"),
))


@dataclass(frozen=True, kw_only=True)
class DeepseekV4Checkpoint:
    """A loaded DeepSeek-V4 folder.

    Attributes
    ----------
    config : DeepseekV4Config
    weights : dict[str, torch.Tensor]
        float32 (integer for ``tid2eid``) CPU tensors under transformers' names.
    with_mtp : bool
        True when the folder carries the MTP layer (``mtp.0.*``).
    """

    config: DeepseekV4Config
    weights: dict[str, torch.Tensor]
    with_mtp: bool


def original_to_hf_name(name: str) -> str:
    """Map one original DeepSeek-V4 tensor name to transformers' name.

    Routed expert tensors (``...ffn.experts.<j>.w1.weight``) are stacked, not renamed:
    see :func:`load_deepseek_v4`. Raises ``KeyError`` for a name outside the table.
    """
    top = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
           "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
           "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale"}
    if name in top:
        return top[name]
    m = re.fullmatch(r"(layers|mtp)\.(\d+)\.(.+)", name)
    if m is None:
        raise KeyError(name)
    kind, index, rest = m.groups()
    prefix = f"model.layers.{index}." if kind == "layers" else f"mtp.{index}."
    if kind == "mtp":
        if rest in _MTP_ONLY:
            return prefix + rest
        head = re.fullmatch(r"hc_head_(fn|base|scale)", rest)
        if head:
            return f"{prefix}hc_head.hc_{head[1]}"
    for pattern, replacement in _BLOCK_RULES:
        hit = pattern.fullmatch(rest)
        if hit:
            try:
                return prefix + (replacement(hit) if callable(replacement) else replacement)
            except KeyError:
                break
    raise KeyError(name)


def is_deepseek_v4_folder(folder: str | Path) -> bool:
    """Whether ``folder/config.json`` describes a DeepSeek-V4 model: ``model_type``
    "deepseek_v4", a ``DeepseekV4ForCausalLM`` architecture, or (no model type given)
    the original release's V4-only fields (``compress_ratios`` with ``hc_mult``).
    False for anything unreadable; the loader that takes it says what is wrong."""
    try:
        raw = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    if not isinstance(raw, dict):
        return False
    if raw.get("model_type") == "deepseek_v4" or "DeepseekV4ForCausalLM" in (raw.get("architectures") or ()):
        return True
    return "model_type" not in raw and "compress_ratios" in raw and "hc_mult" in raw


def read_deepseek_v4_config(folder: str | Path) -> DeepseekV4Config:
    """Read ``config.json`` of a DeepSeek-V4 folder.

    Raises
    ------
    CorruptModelError
        Missing or unreadable ``config.json``, or invalid fields (the message names them).
    UnsupportedModelError
        Another architecture.
    """
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise CorruptModelError(f"{path.parent}: no config.json in the model folder") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptModelError(f"{path}: not a readable JSON file ({exc})") from exc
    if not isinstance(raw, dict):
        raise CorruptModelError(f"{path}: expected a JSON object, found {type(raw).__name__}")
    if raw.get("model_type", "deepseek_v4") != "deepseek_v4":
        raise UnsupportedModelError(f"{path}: model_type {raw['model_type']!r} is not deepseek_v4")
    try:
        return DeepseekV4Config.from_dict(raw)
    except ValueError as exc:
        raise CorruptModelError(f"{path}: invalid DeepSeek-V4 config ({exc})") from exc


def load_deepseek_v4(folder: str | Path) -> DeepseekV4Checkpoint:
    """Read config and weights, dequantized, renamed and stacked (see module doc).

    Raises
    ------
    ModelNotFoundError
        No such folder.
    CorruptModelError
        Missing/unreadable files, a quantized tensor without its scales (or scales of
        the wrong shape), or an incomplete set of experts.
    UnsupportedModelError
        Not a DeepSeek-V4 config, or weights not in safetensors.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelNotFoundError(f"{folder}: no such model folder")
    config = read_deepseek_v4_config(folder)
    block = _fp8_block(json.loads((folder / "config.json").read_text(encoding="utf-8")))
    raw: dict[str, torch.Tensor] = {}
    for file in _weight_files(folder):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                raw.update((name, f.get_tensor(name)) for name in f.keys())
        except (SafetensorError, OSError, ValueError) as exc:
            raise CorruptModelError(f"{file}: not a readable safetensors file ({exc})") from exc
    weights = _to_hf_names(_dequantize_all(raw, block, folder), config, folder)
    weights = {n: w for n, w in weights.items() if not n.startswith("mtp.") or n.startswith("mtp.0.")}
    return DeepseekV4Checkpoint(config=config, weights=weights,
                                with_mtp=any(n.startswith("mtp.0.") for n in weights))


def _fp8_block(raw_config: dict[str, Any]) -> tuple[int, int]:
    quant = raw_config.get("quantization_config") or {}
    size = quant.get("weight_block_size") or FP8_BLOCK
    return int(size[0]), int(size[1])


def _scale_name(name: str, names: dict[str, torch.Tensor]) -> str | None:
    base = name[:-len(".weight")] if name.endswith(".weight") else None
    for candidate in ((base + ".weight_scale_inv", base + ".scale") if base else ()) + (name + "_scale_inv",):
        if candidate in names:
            return candidate
    return None


def _dequantize_all(raw: dict[str, torch.Tensor], block: tuple[int, int],
                    folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    scales_used: set[str] = set()
    for name, tensor in raw.items():
        quantized = tensor.dtype in (torch.float8_e4m3fn, torch.int8)
        scale_name = _scale_name(name, raw) if quantized else None
        if quantized and scale_name is None:
            raise CorruptModelError(f"{folder}: quantized tensor {name} ({tensor.dtype}) has no scales "
                                    "(expected <module>.scale, <module>.weight_scale_inv or <name>_scale_inv)")
        if scale_name is None:
            out[name] = tensor if not tensor.dtype.is_floating_point else tensor.float()
            continue
        scales_used.add(scale_name)
        try:
            if tensor.dtype == torch.int8:
                out[name] = dequantize_fp4(tensor, raw[scale_name])
            else:
                out[name] = dequantize_fp8(tensor, raw[scale_name], block)
        except ValueError as exc:
            raise CorruptModelError(f"{folder}: {name}: {exc}") from exc
    for name in scales_used:
        out.pop(name, None)
    return out


def _to_hf_names(weights: dict[str, torch.Tensor], config: DeepseekV4Config,
                 folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, tensor in weights.items():
        bare = name.removeprefix("model.")
        m = re.fullmatch(r"(layers|mtp)\.(\d+)\.(.+)", bare)
        hit = _EXPERT.fullmatch(m[3]) if m else None
        if hit:
            prefix = f"model.layers.{m[2]}." if m[1] == "layers" else f"mtp.{m[2]}."
            experts.setdefault(prefix, {})[(int(hit[1]), hit[2])] = tensor
            continue
        try:
            out[original_to_hf_name(bare)] = tensor
        except KeyError:  # already transformers' name
            out[name] = tensor
    for prefix, parts in experts.items():
        want = {(j, w) for j in range(config.n_routed_experts) for w in ("w1", "w2", "w3")}
        if set(parts) != want:
            lacking = sorted(want - set(parts))[:3]
            raise CorruptModelError(f"{folder}: routed experts of {prefix} incomplete "
                                    f"(missing e.g. {lacking}; expected {config.n_routed_experts} experts)")
        n = config.n_routed_experts
        out[prefix + "mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat((parts[(j, "w1")], parts[(j, "w3")])) for j in range(n)])
        out[prefix + "mlp.experts.down_proj"] = torch.stack([parts[(j, "w2")] for j in range(n)])
    return out
