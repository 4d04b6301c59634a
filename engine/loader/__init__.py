"""formcast.engine.loader: checkpoints (GGUF files, HF-layout folders) to named weights.

Whatever the source, weights come out under transformers' state-dict names and
shapes (``LlamaForCausalLM`` or the ``*ForCausalLM`` of a family sharing its module:
Qwen2, Qwen3, Mistral, Gemma 3, Phi-3; or ``DeepseekV4ForCausalLM`` plus
``mtp.0.*`` for a DeepSeek-V4 folder), so the model code and the tests can compare
against transformers directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from formcast.engine.config import DeepseekV4Config, LlamaConfig
from formcast.engine.hub import ModelSource
from formcast.engine.loader.gguf import load_gguf, read_gguf_config
from formcast.engine.loader.weight_cache import read_cache, write_cache
from formcast.engine.loader.hf import expected_shapes, load_hf, read_hf_config


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    """A loaded model: its config and its weights.

    Attributes
    ----------
    config : LlamaConfig or DeepseekV4Config
        Shape of the model (its type, and a :class:`~formcast.engine.models.
        decoder_config.DecoderConfig`'s ``architecture``, say which model to build).
    weights : dict[str, torch.Tensor]
        CPU tensors under transformers' ``LlamaForCausalLM`` names (see
        :func:`expected_shapes`; ``lm_head.weight`` only when the head is untied) or
        ``DeepseekV4ForCausalLM`` names (``mtp.0.*`` when the folder has the MTP
        layer; integer routing tables stay integer).
    source : ModelSource
        Where the weights came from.
    from_cache : bool
        True when a GGUF's weights were served from the float32 cache next to it.
    """

    config: LlamaConfig | DeepseekV4Config
    weights: dict[str, torch.Tensor]
    source: ModelSource
    from_cache: bool = False


def load_checkpoint(source: ModelSource, *, dtype: torch.dtype = torch.float32,
                    cache: bool = True) -> Checkpoint:
    """Load the config and weights of a resolved model.

    Parameters
    ----------
    source : ModelSource
        From :func:`formcast.engine.hub.resolve_model`.
    dtype : torch.dtype
        Floating-point dtype of the returned weights.
    cache : bool
        For GGUF sources: read the dequantized float32 weights from
        ``<file>.formcast-f32.safetensors`` when it is up to date, and write that file
        after a fresh load (skipped silently where the folder is not writable).
        Ignored for HF folders, which are read as they are.

    Returns
    -------
    Checkpoint

    Raises
    ------
    ValueError
        ``dtype`` is not a floating-point dtype, or ``source.kind`` is unknown.
    ModelNotFoundError
        The file or folder does not exist.
    CorruptModelError
        The checkpoint is truncated, damaged or inconsistent (the message names the file).
    UnsupportedModelError
        An architecture, tensor type or format formcast does not run.
    """
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch dtype, got {dtype}")
    from_cache = False
    if source.kind == "gguf":
        loaded = read_cache(source.path) if cache else None
        from_cache = loaded is not None
        if loaded is None:
            loaded = load_gguf(source.path)
            if cache:
                write_cache(source.path, *loaded)
    elif source.kind == "hf" and is_deepseek_v4_folder(source.path):
        v4 = load_deepseek_v4(source.path)
        loaded = v4.config, v4.weights
    elif source.kind == "hf":
        loaded = load_hf(source.path)
    else:
        raise ValueError(f"unknown model source kind {source.kind!r} (expected 'gguf' or 'hf')")
    config, weights = loaded
    weights = {name: w.to(dtype) if w.is_floating_point() else w for name, w in weights.items()}
    return Checkpoint(config=config, weights=weights, source=source, from_cache=from_cache)


__all__ = [
    "Checkpoint",
    "expected_shapes",
    "load_checkpoint",
    "read_gguf_config",
    "read_hf_config",
]

from formcast.engine.loader.deepseek_v4 import (  # noqa: E402  (appended: DeepSeek-V4 loading)
    DeepseekV4Checkpoint,
    is_deepseek_v4_folder,
    load_deepseek_v4,
    original_to_hf_name,
    read_deepseek_v4_config,
)

__all__ += [
    "DeepseekV4Checkpoint",
    "is_deepseek_v4_folder",
    "load_deepseek_v4",
    "original_to_hf_name",
    "read_deepseek_v4_config",
]
